"""The engine both pools run: add / abort requests, and ``step()`` = schedule -> run -> postprocess.

Single-threaded by design: a pool replica owns one engine and calls it from one thread.
Runs without Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig, ModelConfig, SamplingParams, served_context_length
from cluster.dtypes import torch_dtype
from cluster.engine.attention import get_attention_backend
from cluster.engine.block_pool import BlockPool
from cluster.engine.cpu_features import advise_dtype
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.host_memory import available_memory_bytes, keep_freed_memory_for_reuse, physical_memory_bytes
from cluster.engine.kv_cache import start_kv_cache
from cluster.engine.layer_ops import choose_layer_ops
from cluster.engine.linear import (
    choose_matmul,
    choose_small_rows_matmul,
    pack_weights,
    use_matmul,
    use_small_rows_matmul,
)
from cluster.engine.model_runner import ModelRunner, RunnerOutput, SampledToken
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampler import skip_one_draw
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.structured import GrammarMatchers, RequestGrammar, consume
from cluster.engine.weights import load_model
from cluster.errors import InvalidRequestError
from cluster.grammar import check_structured
from cluster.kv_layout import check_kv_pools_fit, pool_layout
from cluster.prompting import check_prompt
from cluster.scores import Alternatives, TokenScore
from cluster.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole output)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[float, ...]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    #: Set (with finish_reason "error") when the engine failed on this request; it has ended.
    error: str | None = None
    #: Per new token, its position's most likely tokens (when the request asked for ``top_logprobs``).
    new_top_logprobs: tuple[Alternatives, ...] = ()
    #: With the first output token of a request that asked for ``prompt_logprobs``: the scores of prompt
    #: tokens 1, 2, ... (token 0 has no context to be scored in).
    prompt_logprobs: tuple[TokenScore, ...] | None = None
    #: With the first output token, when this engine computed the prompt: the wall-clock time (``time.time()``)
    #: of the request's first step here (its wait in this engine's queue ends there; tracing reads it).
    first_scheduled_at: float | None = None
    #: Set with ``error`` when the request's own input is at fault (its grammar could not go on): the field a
    #: 400 names ("" for none). None: the engine failed (a 500).
    error_param: str | None = None


@dataclass(frozen=True)
class RemoteKVReservation:
    block_ids: tuple[int, ...]
    #: Leading prompt tokens already in this pool's prefix cache: their blocks need no transfer.
    num_cached_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if torch.device(config.device).type == "cpu":
            keep_freed_memory_for_reuse()  # process-wide: see host_memory for why
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = served_context_length(self.model_config, config.max_model_len)
        dtype = torch_dtype(config.dtype)
        cache = config.cache
        self.kv_layout = pool_layout(self.model_config, config)
        num_blocks = self.kv_layout.num_blocks
        if torch.device(config.device).type == "cpu":
            pools = {"this engine": (1, self.kv_layout)}
            check_kv_pools_fit(pools, available_memory_bytes(), "kv_cache_memory_gb (or num_blocks)")
        # The pool's pages are backed on a thread of its own while the weights load and the kernels are tried.
        pending_kv_cache = start_kv_cache(self.kv_layout, config.device)
        self.model = load_model(self.model_config, dtype, config.device)
        # Each CPU fast path is tried once here and degrades to the portable one where it fails.
        self.matmul = choose_matmul(dtype, config.device)
        small_rows = choose_small_rows_matmul(dtype, config.device)
        self.small_rows_matmul = small_rows is not None and use_small_rows_matmul(
            self.model, small_rows, will_pack=self.matmul.pack is not None, memory_bytes=physical_memory_bytes()
        )
        if self.matmul.pack is not None:
            pack_weights(self.model, self.matmul.pack)
        use_matmul(self.model, self.matmul.fn)
        self.model.layer_ops = choose_layer_ops(dtype, config.device)
        if torch.device(config.device).type == "cpu":
            advise_dtype(dtype, self.matmul.fn)
        self.tokenizer = load_tokenizer(config.model)
        self.grammars = GrammarMatchers(self.tokenizer)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        self.kv_cache = pending_kv_cache.result()
        self.block_pool = BlockPool(num_blocks, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, cache, self.block_pool)
        self.backend = get_attention_backend(config.attention_backend, config.device)
        self.backend.warm_up(self.kv_cache[0, 0], self.kv_cache[0, 1])
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.backend, cache.block_size, config.device, tuple(sorted(self.eos_token_ids))
        )
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._finished_outputs: list[RequestOutput] = []

    # ---- requests ---------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError if the request can never run here. Does not modify the engine."""
        params.validate().check_vocab(self.model_config.vocab_size)
        check_structured(params.structured)
        check_prompt(prompt_token_ids, params.max_tokens, self.model_config.vocab_size, self.max_model_len)
        blocks = -(-(len(prompt_token_ids) + params.max_tokens) // self.kv_layout.block_size)
        if blocks > self.kv_layout.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {blocks} KV blocks but this worker's pool has "
                f"{self.kv_layout.num_blocks}; lower max_tokens or give the KV cache more memory",
                "max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv_on_finish: bool = False,
        grammar: RequestGrammar | None = None,
    ) -> None:
        """``grammar``: the request's fresh matcher, built beforehand off the engine's thread
        (``self.grammars.matcher``); None builds it here."""
        self._admit(request_id, prompt_token_ids, params, hold_kv_on_finish, grammar)
        self.scheduler.add(self.requests[request_id])

    def _admit(self, request_id, prompt_token_ids, params, hold_kv_on_finish=False, grammar=None) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, hold_kv_on_finish=hold_kv_on_finish)
        if params.structured is not None:
            req.matcher = grammar or self.grammars.matcher(params.structured)
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        return req

    def abort_request(self, request_id: str) -> None:
        """Frees the request's blocks at once. Idempotent; safe for unknown or finished ids."""
        req = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if req is None:
            return
        if req.is_finished:
            self.scheduler.release_blocks(req)  # a held prefill result
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._finished_outputs)

    # ---- disaggregation ------------------------------------------------------------------------

    def held_kv_blocks(self, request_id: str) -> list[int]:
        """Block ids holding a finished ``hold_kv_on_finish`` request's prompt KV. Raises for a request still
        running: its blocks are not all written yet, and sending them would hand out a half-computed prompt."""
        req = self.requests[request_id]
        if not req.is_finished:
            raise RuntimeError(f"request {request_id!r} has not finished its prefill; its KV is not complete yet")
        return list(req.block_ids[: -(-req.num_prompt_tokens // self.kv_layout.block_size)])

    def release_kv(self, request_id: str) -> None:
        """Drops a held request and its blocks. Idempotent."""
        self.abort_request(request_id)

    def reserve_remote_kv(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grammar: RequestGrammar | None = None,
    ) -> RemoteKVReservation | None:
        """``grammar`` as in ``add_request``; a caller that tries again after None may pass the same one (it is
        untouched until a reservation succeeds)."""
        if params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "a request asking for prompt_logprobs is prefilled where it decodes: route it LOCAL", "prompt_logprobs"
            )
        req = self._admit(request_id, prompt_token_ids, params, grammar=grammar)
        if not self.scheduler.reserve_remote(req):
            del self.requests[request_id]
            del self._detok[request_id]
            return None
        return RemoteKVReservation(tuple(req.block_ids), req.num_cached_tokens)

    def complete_remote_kv(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: float | None = None,
        first_top_logprobs: Alternatives = (),
    ) -> None:
        req = self.requests[request_id]
        if req.generator is not None and not req.params.greedy:
            # The prefill worker drew the first token from the same seed: continue after that draw.
            skip_one_draw(req.generator)
        self.scheduler.complete_remote(req, first_token_id)
        if first_logprob is not None:
            req.output_logprobs.append(first_logprob)
        # The first token came from the prefill worker; report it (and stop on it) like a sampled one.
        first = SampledToken(first_token_id, first_logprob, first_top_logprobs)
        self._finished_outputs.extend(self._postprocess_tokens([(req, first)]))

    def fallback_to_local_prefill(self, request_id: str) -> None:
        self.scheduler.fallback_to_local(self.requests[request_id])

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return outputs
        try:
            run_out = self.runner.execute(sched_out)
        except Exception as e:  # noqa: BLE001 - whatever it was, it must not end the other requests
            sched_out, run_out, failed = self._run_one_by_one(sched_out, e)
            outputs += failed
        return outputs + self._postprocess(sched_out, run_out)

    def _run_one_by_one(
        self, sched_out: SchedulerOutput, error: Exception
    ) -> tuple[SchedulerOutput, RunnerOutput, list[RequestOutput]]:
        """A step that raised is run again request by request: only the requests that fail alone fail
        (they end with an error output and free their blocks); the others get this step's tokens."""
        log.warning(
            "an engine step of %d requests failed (%r); running them one by one", len(sched_out.scheduled), error
        )
        kept, sampled, prompt_scores, failed = [], {}, {}, []
        for s in sched_out.scheduled:
            try:
                alone = self.runner.execute(SchedulerOutput((s,)))
                sampled.update(alone.sampled)
                prompt_scores.update(alone.prompt_scores)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in the engine", s.request.request_id)
                failed.append(self._fail(s.request, e))
            else:
                kept.append(s)
        return SchedulerOutput(tuple(kept), sched_out.preempted_ids), RunnerOutput(sampled, prompt_scores), failed

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """Ends ``req`` with an error and frees its blocks (held ones too: nobody can use them now)."""
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self.scheduler.release_blocks(req)
        self.requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=(),
            new_text="",
            new_logprobs=(),
            finished=True,
            finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            error=str(error) if isinstance(error, InvalidRequestError) else f"{type(error).__name__}: {error}",
            error_param=(error.param or "") if isinstance(error, InvalidRequestError) else None,
        )

    def _postprocess(self, sched_out: SchedulerOutput, run_out: RunnerOutput) -> list[RequestOutput]:
        self.scheduler.update_after_step(sched_out)
        for request_id, (first, scores) in run_out.prompt_scores.items():
            req = self.requests[request_id]
            # Chunks arrive in order; after a preemption the prompt is computed again: keep what was recorded.
            already = len(req.prompt_scores) - first
            if already >= 0:
                req.prompt_scores.extend(scores[already:])
        sampled = run_out.sampled
        fresh = []
        for s in sched_out.scheduled:
            req = s.request
            if req.request_id in sampled:
                token = sampled[req.request_id]
                req.output_token_ids.append(token.token_id)
                if token.logprob is not None:
                    req.output_logprobs.append(token.logprob)
                fresh.append((req, token))
        return self._postprocess_tokens(fresh)

    def _postprocess_tokens(self, fresh: list[tuple[Request, SampledToken]]) -> list[RequestOutput]:
        outputs = []
        for req, token in fresh:
            try:
                outputs.append(self._postprocess_token(req, token))
            except InvalidRequestError as e:  # its own input (a grammar that cannot go on): the client is told
                log.info("request %s ended: %s", req.request_id, e)
                outputs.append(self._fail(req, e))
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer failure: this request only
                log.exception("postprocessing request %s failed", req.request_id)
                outputs.append(self._fail(req, e))
        return outputs

    def _postprocess_token(self, req: Request, sampled: SampledToken) -> RequestOutput:
        token, logprob = sampled.token_id, sampled.logprob
        detok = self._detok[req.request_id]
        before = len(detok.text)
        detok.push([token])
        grammar_complete = req.matcher is not None and consume(req.matcher, token)
        status = self._stop_status(req, token)
        if status is None and grammar_complete:
            status = RequestStatus.FINISHED_STOPPED  # nothing but EOS could follow
        stop_at = self._find_stop_string(req, detok.text, before)
        if stop_at is not None:
            detok.text, status = detok.text[:stop_at], RequestStatus.FINISHED_STOPPED
        elif status is not None:
            detok.flush()
        new_text = self._emit_text(req, detok, finished=status is not None)
        if status is not None:
            self.scheduler.finish(req, status, release_blocks=not req.hold_kv_on_finish)
            if not req.hold_kv_on_finish:
                self.requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=(token,),
            new_text=new_text,
            new_logprobs=(logprob,) if logprob is not None else (),
            new_top_logprobs=(sampled.top_logprobs,) if req.params.top_logprobs else (),
            prompt_logprobs=tuple(req.prompt_scores)
            if req.params.prompt_logprobs is not None and len(req.output_token_ids) == 1
            else None,
            finished=status is not None,
            finish_reason=status.finish_reason if status is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            first_scheduled_at=req.first_scheduled_at if len(req.output_token_ids) == 1 else None,
        )

    @staticmethod
    def _emit_text(req: Request, detok: IncrementalDetokenizer, finished: bool) -> str:
        """Text not yet streamed. While stop strings may still complete, the last
        ``len(longest stop) - 1`` characters are held back: streamed text cannot be taken back."""
        holdback = 0 if finished or not req.params.stop else max(map(len, req.params.stop)) - 1
        end = max(detok.emitted, len(detok.text) - holdback)
        new_text = detok.text[detok.emitted : end]
        detok.emitted = end
        return new_text

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        # Before min_tokens the sampler never picks a stop id; the length check keeps the rule in one obvious place.
        is_stop = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        if is_stop and len(req.output_token_ids) > p.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _find_stop_string(req: Request, text: str, before: int) -> int | None:
        """Where the returned text ends if a stop string completed in the new text, else None."""
        if not req.params.stop or len(req.output_token_ids) <= req.params.min_tokens:
            return None  # as in vLLM: stop strings count only after min_tokens tokens
        best = None
        for stop in req.params.stop:
            i = text.find(stop, max(0, before - len(stop) + 1))
            if i != -1:
                end = i + len(stop) if req.params.include_stop_str_in_output else i
                best = end if best is None else min(best, end)
        return best

    # ---- convenience -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Runs prompts to completion; returns per prompt {token_ids, text, finish_reason, logprobs, top_logprobs}."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=False):
            self.add_request(rid, prompt, p)
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                outputs[out.request_id].append(out)
        return [
            {
                "token_ids": [t for o in outputs[rid] for t in o.new_token_ids],
                "text": "".join(o.new_text for o in outputs[rid]),
                "finish_reason": outputs[rid][-1].finish_reason if outputs[rid] else None,
                "logprobs": [lp for o in outputs[rid] for lp in o.new_logprobs],
                "top_logprobs": [a for o in outputs[rid] for a in o.new_top_logprobs],
                "prompt_logprobs": next((o.prompt_logprobs for o in outputs[rid] if o.prompt_logprobs), None),
            }
            for rid in ids
        ]
