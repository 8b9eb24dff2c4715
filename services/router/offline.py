"""Offline batch inference, as vLLM's ``LLM`` class: prompts in, their finished outputs back
in the same order, in this process (no server).

    from specmesh import LLM, SamplingParams
    llm = LLM()                      # the bundled models; LLM(model=DIR) loads a local HF directory
    outs = llm.generate(["def add(a, b):", "import os"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text, outs[0].metrics["tau"])

Up to ``max_num_seqs`` requests decode at once, each in a thread of its own, so their cycles
share the verifier's batched steps (one target forward for all of them), as the server's
streams do. Every request is checked before any decodes: a bad one raises ``ValueError``
naming the prompt and the field. Names and defaults follow vLLM's ``SamplingParams``
(``temperature`` 1.0 samples, 0 is greedy; ``max_tokens`` 16, None for what the context
leaves); ``method`` picks the speculative method (default: the engine's, ``hybrid`` on the
bundled zoo), per ``LLM`` or per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import EngineConfig, models_dir
from services.common.progress import run_concurrently
from services.common.types import Sampling, TokenLogprob
from services.router import openai_api as oa
from services.router.engine import Engine, Generation, GenerationRequest, InvalidRequest
from services.router.tools import template_messages


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling parameters, with its names and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: what the context leaves after the prompt
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # per output token: its log-probability and this many alternatives
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None  # words the output may not complete
    structured_outputs: dict | None = None  # exactly one of json (schema), regex, choice, json_object
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability under the target, its rank among the alternatives
    returned (1 = the most likely; None when it is not among them) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or a stop), "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: it and the alternatives, by token id


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token (None for the first)
    finished: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)  # the first completion's decoding stats (τ, cycles, ...)


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        draft: str | Path | None = None,
        eagle3: str | Path | None = None,
        method: str | None = None,
        max_num_seqs: int = 8,
        **engine_options,
    ):
        """``model``: a local Hugging Face directory (default: the bundled target, with the bundled
        draft LM, EAGLE-3 head and predictor beside it; a model of your own brings its own
        ``draft`` and ``eagle3``, if any). ``engine_options``: ``EngineConfig`` fields (device,
        dtype, num_speculative_tokens, prefix_cache_mb, ...)."""
        bundled = model is None
        cfg = EngineConfig(
            target=Path(model) if model else models_dir() / "target",
            draft=Path(draft) if draft else (models_dir() / "draft" if bundled else None),
            eagle3=Path(eagle3) if eagle3 else (models_dir() / "eagle3" if bundled else None),
            predictor=models_dir() / "predictor" if bundled else None,
            ocm_snapshot=models_dir() / "ocm_snapshot.json" if bundled else None,
            **engine_options,
        )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        self.engine = Engine(cfg)
        self.method = method or self.engine.default_method
        self.max_num_seqs = max_num_seqs
        self._ids = 0

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        method: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. A prompt is text, token ids, or vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``; ``sampling_params`` is one for
        all or one per prompt."""
        each = [prompts] if isinstance(prompts, str) else list(prompts)
        params = _per_prompt(sampling_params, len(each))
        jobs = [self._request(i, p, sp, method or self.method) for i, (p, sp) in enumerate(zip(each, params))]
        return run_concurrently(
            lambda job: self._run(*job),
            jobs,
            self.max_num_seqs,
            "Processed prompts",
            "prompts",
            progress=use_tqdm and len(jobs) > 1,
            bar=True,
            every_s=5.0,
            tokens=lambda out: sum(len(c.token_ids) for c in out.outputs),
        )

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        method: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or several, each rendered
        by ``chat_template`` (the Jinja text; default: the tokenizer's) and generated as a
        prompt of token ids. The bundled code model has no template: pass one."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conv in enumerate(convs):
            try:
                msgs = template_messages(oa.checked_messages({"messages": conv}))
                prompts.append(
                    {
                        "prompt_token_ids": oa.chat_prompt(
                            self.engine.tokenizer, msgs, chat_template, add_generation_prompt
                        )
                    }
                )
            except InvalidRequest as e:
                raise ValueError(f"conversation {i}: {e}") from None
        return self.generate(prompts, sampling_params, method=method, use_tqdm=use_tqdm)

    def _request(self, i: int, prompt, sp: SamplingParams, method: str) -> tuple:
        """(request id, prompt text, request), checked as the engine would check it."""
        text, ids = _prompt(i, prompt, self.engine)
        self._ids += 1
        try:
            max_new = sp.max_tokens if sp.max_tokens is not None else self.engine.context_len - len(ids)
            req = GenerationRequest(
                prompt_ids=ids,
                max_new_tokens=max_new,
                method=method,
                n=sp.n,
                sampling=Sampling(
                    sp.temperature,
                    sp.top_p,
                    max(0, sp.top_k),
                    sp.seed,
                    sp.repetition_penalty,
                    sp.presence_penalty,
                    sp.frequency_penalty,
                    tuple(sorted((int(k), float(v)) for k, v in (sp.logit_bias or {}).items())),
                    tuple(sp.allowed_token_ids or ()),
                    self.engine.bad_word_ids(sp.bad_words or ()),
                    sp.min_p,
                ),
                structured=oa.structured_outputs(sp.structured_outputs) if sp.structured_outputs else None,
                stop=(sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ()),
                stop_token_ids=tuple(sp.stop_token_ids or ()),
                include_stop_str_in_output=sp.include_stop_str_in_output,
                logprobs=sp.logprobs,
                prompt_logprobs=sp.prompt_logprobs,
                ignore_eos=sp.ignore_eos,
                min_tokens=sp.min_tokens,
                skip_special_tokens=sp.skip_special_tokens,
                request_id=f"llm-{self._ids}",
            )
            self.engine.validate(req)
            self.engine.compile_grammar(req)  # offline: every request's errors before any runs
        except InvalidRequest as e:  # the field as vLLM names it (max_tokens, ...)
            raise ValueError(f"prompt {i}: {oa.openai_message(e)}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"prompt {i}: {e}") from None
        return req.request_id, text, req

    def _run(self, rid: str, text: str | None, req: GenerationRequest) -> RequestOutput:
        completions = self.engine.generate_all(req)
        for _ in completions:
            pass
        gens, tok = completions.gens, self.engine.tokenizer
        prompt_lps = None
        if req.prompt_logprobs is not None:
            prompt_lps = [None] + [_logprobs(x, tok) for x in gens[0].prompt_logprobs]
        return RequestOutput(
            rid,
            text,
            list(req.prompt_ids),
            [_completion(i, g, tok) for i, g in enumerate(gens)],
            prompt_lps,
            metrics=gens[0].result()["stats"],
        )

    def get_tokenizer(self):
        """The target's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params: give one SamplingParams, or one per prompt ({n}), got {len(params)} items")
    return params


def _prompt(i: int, prompt, engine: Engine) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of prompt ``i``, encoded as the API encodes prompts."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        elif set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        else:
            raise ValueError(f"prompt {i}: a dict prompt holds exactly one of prompt, prompt_token_ids")
    if isinstance(prompt, str):
        return prompt, engine.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"prompt {i}: must be text, a list of token ids, or a dict; got {type(prompt).__name__}")


def _completion(index: int, gen: Generation, tokenizer) -> CompletionOutput:
    lps = [_logprobs(x, tokenizer) for x in gen.logprobs] if gen.req.logprobs is not None else None
    return CompletionOutput(
        index,
        gen.text,
        list(gen.output_ids),
        oa.FINISH.get(gen.finish_reason or "", gen.finish_reason or ""),  # finished: a reason is set
        gen.stop_reason,
        sum(x.logprob for x in gen.logprobs) if lps is not None else None,
        lps,
    )


def _logprobs(x: TokenLogprob, tokenizer) -> dict[int, Logprob]:
    """A position's token and its alternatives (best first), as vLLM's ``{token id: Logprob}``."""
    ranks = {t: r for r, (t, _) in enumerate(x.top, 1)}
    out = {x.token_id: Logprob(x.logprob, ranks.get(x.token_id), tokenizer.decode([x.token_id]))}
    for t, v in x.top:
        out.setdefault(t, Logprob(v, ranks[t], tokenizer.decode([t])))
    return out
