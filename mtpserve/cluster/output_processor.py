"""Turns the scheduler's accepted tokens into RequestOutputs: detokenization, stop strings, logprobs."""

from __future__ import annotations

import time

from mtpserve.cluster.request import Request
from mtpserve.cluster.tokenizer import IncrementalDetokenizer, Tokenizer
from mtpserve.outputs import RequestOutput


class _TextState:
    def __init__(self, detok: IncrementalDetokenizer | None, stops: tuple[str, ...]) -> None:
        self.detok, self.stops = detok, stops
        self.full = ""  # all text decoded so far; out.text trails it while a stop string may still form
        self.hold = max((len(s) for s in stops), default=1) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.outputs: dict[str, RequestOutput] = {}
        self._text: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        prompt = req.token_ids[: req.num_prompt_tokens]
        self.outputs[req.request_id] = RequestOutput(
            req.request_id, prompt, arrival_time=req.arrival_time,
            logprobs=[] if req.params.logprobs is not None else None,
        )
        detok = IncrementalDetokenizer(self.tokenizer, prompt) if self.tokenizer is not None else None
        self._text[req.request_id] = _TextState(detok, req.params.stop)

    def process(self, req: Request, new_tokens: list[int], logprobs: list[dict[int, float]] | None) -> RequestOutput:
        """Record the tokens a step kept; returns the output carrying this step's deltas.

        A stop string in the text finishes the request ("stop"): the text ends right before it, and
        tokens after the one that completed it are dropped.
        """
        out, state = self.outputs[req.request_id], self._text[req.request_id]
        kept, stopped = self._detokenize(state, new_tokens)
        if stopped:
            req.finish_reason = "stop"
        elif req.finish_reason is not None and state.detok is not None:
            # Ended by a token (eos, length): a character its last bytes cut short shows as U+FFFD, as a whole decode
            # shows it.
            state.full += state.detok.flush()
        out.new_token_ids = new_tokens[:kept]
        out.token_ids += out.new_token_ids
        out.new_logprobs = logprobs[:kept] if logprobs is not None else None
        if out.logprobs is not None and out.new_logprobs is not None:
            out.logprobs += out.new_logprobs
        self._emit_text(out, state, flush=req.finish_reason is not None)
        out.accepted_per_step = req.accepted_per_step
        out.first_scheduled_time, out.first_token_time = req.first_scheduled_time, req.first_token_time
        return out

    def finish(self, req: Request) -> RequestOutput:
        """The final output of a finished or aborted request (its remaining held-back text flushed)."""
        out, state = self.outputs.pop(req.request_id), self._text.pop(req.request_id)
        if req.finish_reason == "abort":
            out.new_token_ids, out.new_logprobs = [], None
            self._emit_text(out, state, flush=True)
        out.finish_reason = req.finish_reason
        out.finished_time = time.monotonic()
        return out

    @staticmethod
    def _detokenize(state: _TextState, new_tokens: list[int]) -> tuple[int, bool]:
        """Append the tokens' text to state.full -> (tokens kept, whether a stop string ended it)."""
        if state.detok is None:
            return len(new_tokens), False
        if not state.stops:
            state.full += state.detok.push(new_tokens)
            return len(new_tokens), False
        for i, token in enumerate(new_tokens):  # token by token, so the text can end exactly before a stop
            before = len(state.full)
            state.full += state.detok.push([token])
            cut = _find_stop(state.full, state.stops, before)
            if cut is not None:
                state.full = state.full[:cut]
                return i + 1, True
        return len(new_tokens), False

    @staticmethod
    def _emit_text(out: RequestOutput, state: _TextState, flush: bool) -> None:
        end = len(state.full) if flush or not state.stops else max(len(out.text), len(state.full) - state.hold)
        out.new_text = state.full[len(out.text) : end]
        out.text += out.new_text


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string begins, looking only where a new match can start."""
    start = max(0, search_from - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
