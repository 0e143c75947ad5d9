"""The Python API for offline and embedded use (docs/offline.md): ``LLM`` and its ``SamplingParams`` (llm.py), the
handles and results it gives (results.py), and ``python -m inference_api.offline.generate`` for a file of prompts.
The package's public names are listed once, in ``inference_api``'s lazy exports."""

from .llm import LLM as LLM
from .llm import Conversation as Conversation
from .llm import EngineError as EngineError
from .llm import ParameterError as ParameterError
from .llm import SamplingParams as SamplingParams
from .results import Output as Output
from .results import RequestHandle as RequestHandle
from .results import RequestOutput as RequestOutput
from .results import RequestStatus as RequestStatus
from .results import ResultQueue as ResultQueue
