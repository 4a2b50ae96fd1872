"""Turns a ``SchedulerOutput`` into one model forward and one sampling pass.

Builds the flat token batch (input ids, positions, KV slots) and the attention metadata
with numpy, runs the model over every scheduled token at once, computes logits only for
rows that sample, and returns a plain ``RunnerOutput``. It never changes request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cluster.engine.attention.base import AttentionBackend, AttentionMetadata
from cluster.engine.model import LlamaForCausalLM
from cluster.engine.sampler import sample, score_tokens
from cluster.engine.scheduler import SchedulerOutput
from cluster.scores import Alternatives, TokenScore

#: Rows of logits computed at once when scoring a prompt (bounds the [rows, vocab] tensor of a long chunk).
SCORE_ROWS = 256


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    #: The token's logprob, None when the request did not ask for logprobs.
    logprob: float | None = None
    #: The position's most likely tokens (``top_logprobs`` of them), () when not asked.
    top_logprobs: Alternatives = ()


@dataclass(frozen=True)
class RunnerOutput:
    #: request id -> what was sampled, for requests whose step reached their last token.
    sampled: dict[str, SampledToken]
    #: request id -> (i, scores): for requests asking ``prompt_logprobs``, the scores of prompt tokens i + 1,
    #: i + 2, ... that this step's chunk predicts.
    prompt_scores: dict[str, tuple[int, list[TokenScore]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        device,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.model = model
        #: What ``min_tokens`` holds back (with each request's own stop ids).
        self.eos_token_ids = eos_token_ids
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        reqs = [s.request for s in out.scheduled]
        qlens = [s.num_tokens for s in out.scheduled]
        starts = [r.num_computed_tokens for r in reqs]
        seq_lens = [s + q for s, q in zip(starts, qlens, strict=False)]
        token_ids = np.fromiter(
            (t for r, s, n in zip(reqs, starts, seq_lens, strict=True) for t in r.tokens(s, n)),
            dtype=np.int64,
            count=sum(qlens),
        )
        # positions: start..start+qlen-1 for every request, vectorized via repeat + a running offset.
        qlens_np = np.asarray(qlens, dtype=np.int64)
        cu = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens_np, out=cu[1:])
        positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(
            cu[:-1] - np.asarray(starts, dtype=np.int64), qlens_np
        )
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_table = np.zeros((len(reqs), max_blocks), dtype=np.int32)
        for i, r in enumerate(reqs):
            block_table[i, : len(r.block_ids)] = r.block_ids
        seq_index = np.repeat(np.arange(len(reqs)), qlens_np)
        slots = block_table[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_table).to(dev),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for q in qlens if q == 1),
            seq_lens_list=tuple(seq_lens),
            query_lens_list=tuple(qlens),
        )
        return torch.from_numpy(token_ids).to(dev), torch.from_numpy(positions).to(dev), meta

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend)
        prompt_scores = self._score_prompts(out, hidden, meta)
        sampling = [i for i, s in enumerate(out.scheduled) if s.samples]
        if not sampling:
            return RunnerOutput({}, prompt_scores)
        last_rows = meta.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last_rows[sampling]])
        reqs = [out.scheduled[i].request for i in sampling]
        result = sample(
            logits,
            [r.params for r in reqs],
            [r.generator for r in reqs],
            reqs,
            self.eos_token_ids,
            [r.matcher for r in reqs],
        )
        rows = zip(reqs, result.token_ids, result.logprobs, result.top_logprobs, strict=True)
        return RunnerOutput({r.request_id: SampledToken(t, lp, top) for r, t, lp, top in rows}, prompt_scores)

    def _score_prompts(
        self, out: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> dict[str, tuple[int, list[TokenScore]]]:
        """Scores of the prompt tokens each chunk predicts, for the requests that asked (only those pay: their
        chunk's rows go through the LM head, in slices of SCORE_ROWS)."""
        scores: dict[str, tuple[int, list[TokenScore]]] = {}
        row_starts: list[int] | None = None
        for i, s in enumerate(out.scheduled):
            req = s.request
            num_top = req.params.prompt_logprobs
            first = req.num_computed_tokens  # the chunk's first position; it predicts token first + 1
            end = min(first + s.num_tokens, req.num_prompt_tokens - 1)
            if num_top is None or end <= first:
                continue
            if row_starts is None:
                row_starts = meta.query_start_loc.tolist()
            row0 = row_starts[i]
            targets = torch.tensor(req.prompt_token_ids[first + 1 : end + 1], device=hidden.device)
            chunk: list[TokenScore] = []
            for a in range(0, end - first, SCORE_ROWS):
                b = min(a + SCORE_ROWS, end - first)
                chunk += score_tokens(self.model.compute_logits(hidden[row0 + a : row0 + b]), targets[a:b], num_top)
            scores[req.request_id] = (first, chunk)
        return scores
