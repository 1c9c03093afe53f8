"""mtpserve: serving for language models with multi-token-prediction (MTP) modules."""

from mtpserve.outputs import CompletionLogprobs, RequestOutput
from mtpserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionLogprobs"]


def __getattr__(name: str):  # LLM pulls in torch and the engine: import it on first use only
    if name == "LLM":
        from mtpserve.llm import LLM

        return LLM
    raise AttributeError(name)
