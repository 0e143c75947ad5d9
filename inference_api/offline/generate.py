"""``python -m inference_api.offline.generate INPUT.jsonl OUTPUT.jsonl [--params JSON] [server flags]``: a file of
prompts through the offline API (docs/offline.md).

Each input line is a JSON object: ``prompt`` (text or token ids) or ``messages`` (a chat conversation), an
optional ``id`` copied to the output, and any sampling parameter (``max_tokens``, ``temperature``...) over the
``--params`` defaults. With an embedding model each line is ``{"input": text, "id"?}`` and its output line carries
``embedding`` and ``prompt_tokens``; with a reranker ``{"query", "documents", "id"?}`` and ``scores``.
Each output line answers one input line, in input order: ``line`` (its 1-based number),
``id``, ``text``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens`` (and ``logprobs`` when asked), or
``error`` for a line that cannot run. Blank lines are skipped. Run again with the same output file after an
interruption: the lines already answered are skipped and the rest appended, so nothing is lost or repeated.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import build_parser, flag_values
from .llm import LLM, Conversation, EngineError, ParameterError, RequestOutput, SamplingParams

_LINE_KEYS = {"prompt", "messages", "id"}


def answered_lines(output: Path) -> set[int]:
    """The input lines the output file already answers; a last line cut short by a kill is removed."""
    if not output.exists():
        return set()
    done, keep = set(), 0
    with output.open("rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
                done.add(int(record["line"]))
            except (ValueError, KeyError, TypeError):
                break
            if not raw.endswith(b"\n"):
                break
            keep += len(raw)
    if keep != output.stat().st_size:
        with output.open("r+b") as f:
            f.truncate(keep)
    return done


def parse_line(raw: str, defaults: SamplingParams) -> tuple[Any, Any, SamplingParams]:
    """(id, prompt, params) of one input line; ParameterError or ValueError if it is malformed."""
    try:
        obj = json.loads(raw)
    except ValueError as err:
        raise ParameterError(f"not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ParameterError("each line must be a JSON object with prompt or messages")
    if ("prompt" in obj) == ("messages" in obj):
        raise ParameterError("each line needs exactly one of prompt or messages", "prompt")
    sampling = {k: v for k, v in obj.items() if k not in _LINE_KEYS}
    params = SamplingParams(**{**defaults.params, **sampling}) if sampling else defaults
    prompt = Conversation(obj["messages"]) if "messages" in obj else obj["prompt"]
    return obj.get("id"), prompt, params


class Jobs:
    """The input lines still to answer, read lazily; ``order`` records each one (with its error, if any) so
    the writer can put error lines in their place among the results."""

    def __init__(self, path: Path, skip: set[int], defaults: SamplingParams):
        self.path, self.skip, self.defaults = path, skip, defaults
        self.order: collections.deque[tuple[int, Any, str | None]] = collections.deque()
        with path.open(encoding="utf-8") as f:  # the lines that will run: the progress bar's total
            self.total = sum(1 for n, raw in enumerate(f, 1) if raw.strip() and n not in skip and self._ok(raw))

    def _ok(self, raw: str) -> bool:
        try:
            parse_line(raw, self.defaults)
            return True
        except ParameterError:
            return False

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[tuple[Any, SamplingParams]]:
        with self.path.open(encoding="utf-8") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip() or n in self.skip:
                    continue
                try:
                    line_id, prompt, params = parse_line(raw, self.defaults)
                except ParameterError as err:
                    self.order.append((n, _id_of(raw), str(err)))
                    continue
                self.order.append((n, line_id, None))
                yield prompt, params


def _id_of(raw: str) -> Any:
    try:
        obj = json.loads(raw)
        return obj.get("id") if isinstance(obj, dict) else None
    except ValueError:
        return None


def result_record(line: int, line_id: Any, result: RequestOutput) -> dict:
    record: dict[str, Any] = {"line": line}
    if line_id is not None:
        record["id"] = line_id
    if result.error is not None and result.finish_reason == "error":
        return {**record, "error": result.error, "finish_reason": "error"}
    record.update(
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
    )
    if result.logprobs is not None:
        record["logprobs"] = [
            {"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in result.logprobs
        ]
    return record


def run(llm: LLM, input_path: Path, output_path: Path, defaults: SamplingParams, progress: bool = True) -> int:
    """Answer every input line not yet in the output file; return how many lines were written."""
    jobs = Jobs(input_path, answered_lines(output_path), defaults)
    written = 0
    with output_path.open("a", encoding="utf-8") as out:

        def write(record: dict) -> None:
            nonlocal written
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            written += 1

        def write_errors_before_next_job() -> None:
            while jobs.order and jobs.order[0][2] is not None:
                n, line_id, error = jobs.order.popleft()
                write(
                    {
                        "line": n,
                        **({"id": line_id} if line_id is not None else {}),
                        "error": error,
                        "finish_reason": "error",
                    }
                )

        for result in llm.generate_iter(jobs, use_tqdm=progress, errors="return"):
            write_errors_before_next_job()
            n, line_id, _ = jobs.order.popleft()
            write(result_record(n, line_id, result))
        write_errors_before_next_job()
        os.fsync(out.fileno())
    return written


EMBED_BATCH = 64  # lines embedded or scored per engine request


def run_inputs(llm: LLM, input_path: Path, output_path: Path) -> int:
    """An embedding model's or a reranker's file: each line embedded (``input``) or scored (``query`` and
    ``documents``), in batches, resumed as ``run`` is."""
    done = answered_lines(output_path)
    written = 0
    with output_path.open("a", encoding="utf-8") as out, input_path.open(encoding="utf-8") as lines:

        def write(record: dict) -> None:
            nonlocal written
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            written += 1

        batch: list[tuple[int, Any, str]] = []

        def flush() -> None:
            if not batch:
                return
            try:
                vectors = llm.embed([text for _, _, text in batch])
            except ParameterError:  # one line too long: each line on its own, to say which
                vectors = []
                for _, _, text in batch:
                    try:
                        vectors.append(llm.embed(text)[0])
                    except ParameterError as err:
                        vectors.append(str(err))  # type: ignore[arg-type]
            for (n, line_id, text), vector in zip(batch, vectors):
                key = {"id": line_id} if line_id is not None else {}
                if isinstance(vector, str):
                    write({"line": n, **key, "error": vector})
                else:
                    write({"line": n, **key, "embedding": vector, "prompt_tokens": len(llm.tokenizer.encode(text))})
            batch.clear()

        for n, raw in enumerate(lines, 1):
            if n in done or not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError("each line must be a JSON object")
                line_id = obj.get("id")
                if llm.task == "score":
                    flush()
                    scores = llm.rerank(str(obj["query"]), [str(d) for d in obj["documents"]])
                    write({"line": n, **({"id": line_id} if line_id is not None else {}), "scores": scores})
                    continue
                if not isinstance(obj.get("input"), str):
                    raise ValueError("each line needs input: a string")
                batch.append((n, line_id, obj["input"]))
                if len(batch) >= EMBED_BATCH:
                    flush()
            except (ValueError, KeyError, TypeError, ParameterError) as err:
                flush()
                write({"line": n, "error": str(err)})
        flush()
        os.fsync(out.fileno())
    return written


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(os.environ)
    parser.prog = "python -m inference_api.offline.generate"
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("input", type=Path, help="JSONL file of prompts")
    parser.add_argument("output", type=Path, help="JSONL file of results (appended to; resumed if it exists)")
    parser.add_argument("--params", default="{}", help="default sampling parameters as a JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = vars(parser.parse_args(argv))
    options = flag_values(args)  # the flags (no env-only secret)
    if options.pop("models"):
        parser.error("--model: the JSONL job runs one model")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the engine on the way out
    try:
        defaults = SamplingParams(**json.loads(args["params"]))
    except (ValueError, TypeError) as err:
        parser.error(f"--params: {err}")
    with LLM(**options) as llm:
        try:
            if llm.task in ("embed", "score"):
                written = run_inputs(llm, args["input"], args["output"])
            else:
                written = run(llm, args["input"], args["output"], defaults, not args["no_progress"])
        except EngineError as err:
            print(f"stopped: {err}; run the same command again to resume", file=sys.stderr)
            return 1
    print(f"{written} line(s) written to {args['output']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
