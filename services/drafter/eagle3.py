"""EAGLE-3 draft head (arXiv 2503.01840): one decoder layer over fused target features.

Step at position i (shapes for one sequence; H = head hidden size):
    h_i      = fc(cat(f_low, f_mid, f_high)_i)          target features, 3·H_t → H   (step 0)
             | prenorm output of the previous step          (chain steps ≥ 1: own hidden state)
    x_i      = cat(input_layernorm(embed(token_{i+1})), hidden_norm(h_i))            2H
    r_i      = h_i + o_proj(attention(x_i))                 causal over the head's cache
    out_i    = r_i + mlp(post_attention_layernorm(r_i))     prenorm: the next chain step's h
    logits_i = lm_head(norm(out_i))                         draft vocabulary; target id = d + d2t[d]

Checkpoint format = published EAGLE-3 heads (config.json + safetensors): ``fc.*``,
``midlayer.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``; config keys ``draft_vocab_size``
and ``eagle_config.eagle_aux_hidden_state_layer_ids``. Embeddings are the target's, frozen
(loaded from the checkpoint when it carries ``embed_tokens.weight``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.common.llama import MLP, Attention, KVCache, LlamaShape, RMSNorm, _rope_tables, attend_rows, token_ids
from services.common.sampling import greedy_ids


class MidLayer(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.s = s
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s, in_features=2 * s.hidden, bias=False)  # its projections and RoPE
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)

    def qkv(self, e, h, cos, sin, q_index: torch.Tensor | slice | None = None):
        """[B, T, H] normed embeddings (``Eagle3Head.embed_in``) and hidden → rotated q [B, nh, T, d],
        k/v [B, nkv, T, d] (``Attention.project``); q only at positions ``q_index`` when given
        (inference attends from the last ones only)."""
        q, k, v = self.self_attn.project(torch.cat([e, self.hidden_norm(h)], dim=-1), cos, sin)
        return (q if q_index is None else q[:, :, q_index]), k, v

    def finish(self, attn_out, h):
        """attn_out [B, nh, T, d], residual h [B, T, H] → prenorm output [B, T, H]."""
        b, _, t, _ = attn_out.shape
        r = h + self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # buffers: draft id -> target id offset; target ids in the draft vocabulary
    t2d: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg):
        super().__init__()
        s = LlamaShape.from_hf(cfg)
        self.s, self.cfg = s, cfg
        target_hidden = getattr(cfg, "target_hidden_size", None) or s.hidden
        self.draft_vocab = getattr(cfg, "draft_vocab_size", None) or s.vocab
        self.aux_layers = tuple(cfg.eagle_config["eagle_aux_hidden_state_layer_ids"])
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * target_hidden, s.hidden, bias=False)
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, self.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab, dtype=torch.bool))
        self.remaps_vocab = self.draft_vocab != s.vocab  # set from d2t on load; training keeps d2t = 0
        self._embed_in, self._embed_in_key = None, None  # inference: see embed_in
        self._d2t, self._d2t_key = None, None
        cos, sin = _rope_tables(cfg, s.max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, positions: torch.Tensor | slice, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at ``positions``; a slice (consecutive positions) takes a view, no gather."""
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def embed_in(self, tokens: torch.Tensor) -> torch.Tensor:
        """input_layernorm(embed(tokens)), looked up in a table of every token's, re-made when
        either weight changes. A row's norm depends on that row alone: the same values as
        computing it per step, one gather instead of a gather and a norm."""
        w, g = self.embed_tokens.weight, self.midlayer.input_layernorm.weight
        key = (w.data_ptr(), w._version, g.data_ptr(), g._version)
        if self._embed_in_key != key:
            with torch.no_grad():
                self._embed_in = self.midlayer.input_layernorm(w)
            self._embed_in_key = key
        return self._embed_in[tokens]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy(self, logits: torch.Tensor) -> int:
        """Target id of the draft vocabulary's argmax (no scatter into the target vocabulary)."""
        d = greedy_ids(logits[None])[0]
        return d + self._d2t_list()[d] if self.remaps_vocab else d

    def _d2t_list(self) -> list[int]:
        """d2t as a Python list (a list read, not a tensor index and a sync), re-made when d2t changes."""
        key = (self.d2t.data_ptr(), self.d2t._version)
        if self._d2t_key != key:
            self._d2t, self._d2t_key = self.d2t.tolist(), key
        return self._d2t

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits → target-vocabulary logits (-inf outside the draft vocabulary)."""
        if not self.remaps_vocab:  # decided once at load: no per-step reduction (a sync on CUDA)
            return logits
        out = logits.new_full((*logits.shape[:-1], self.s.vocab), float("-inf"))
        out[..., self.to_target_ids(torch.arange(self.draft_vocab, device=logits.device))] = logits
        return out

    def step(self, h: torch.Tensor, tokens: torch.Tensor, start: int, cache: KVCache):
        """Run positions start..start+T-1: K/V of all of them into the head's cache; attention,
        MLP and LM head for the last one only, all a chain step needs (a catch-up over many
        positions costs little more than their K/V) → (draft-vocab logits [B, 1, V_d], prenorm [B, 1, H]).
        ``greedy`` and ``target_logits`` map them to target ids."""
        t = tokens.shape[1]
        cos, sin = self.rope(slice(start, start + t), h.dtype)
        q, k, v = self.midlayer.qkv(self.embed_in(tokens), h, cos, sin, slice(t - 1, t))
        kc, vc = cache.layers[0]
        kc[:, :, start : start + t] = k
        vc[:, :, start : start + t] = v
        o = F.scaled_dot_product_attention(
            q,
            kc[:, :, : start + t],
            vc[:, :, : start + t],  # the last sees all
            enable_gqa=self.s.kv_heads != self.s.heads,
        )
        out = self.midlayer.finish(o, h[:, -1:])
        return self.lm_head(self.norm(out)), out

    def step_ragged(
        self,
        hs: list[torch.Tensor],
        tokens: Sequence[list[int] | torch.Tensor],
        starts: list[int],
        caches: list[KVCache],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``step`` for several requests at once: row r runs ``tokens[r]`` with inputs hs[r]
        [T_r, H] at positions starts[r].. of caches[r]. Projections and MLP run once over all
        rows, attention per row. Returns per-row draft-vocab logits [1, V_d] and prenorm [1, H]
        of each row's last position."""
        if len(hs) == 1:
            dev = hs[0].device
            logits, out = self.step(hs[0][None], token_ids(tokens[:1], dev)[None], starts[0], caches[0])
            return [logits[0]], [out[0]]
        dev, lens = hs[0].device, [len(t) for t in tokens]
        h = torch.cat(hs)[None]
        ids = token_ids(tokens, dev)[None]
        pos = torch.cat([torch.arange(st, st + n, device=dev) for st, n in zip(starts, lens)])
        ends = list(itertools.accumulate(lens))
        last = torch.tensor(ends, device=dev) - 1
        cos, sin = self.rope(pos, h.dtype)
        q, k, v = self.midlayer.qkv(self.embed_in(ids), h, cos, sin, last)
        offsets = [end - n for end, n in zip(ends, lens)]
        rows = [(off, st, c.layers[0], None) for off, st, c in zip(offsets, starts, caches)]
        o = attend_rows(q[0], k[0], v[0], rows, self.s.kv_heads != self.s.heads, last_only=True)
        out = self.midlayer.finish(o[None], h[:, last])[0]
        logits = self.lm_head(self.norm(out))
        return list(logits[:, None]), list(out[:, None])

    def step_tree(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: list[tuple[int, torch.Tensor, torch.Tensor, KVCache]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand token-tree nodes, of several requests at once: node j runs ``tokens[j]`` on
        input h[j] ([M, H]) at RoPE position positions[j]. ``rows``: per request (its first
        node's index, the cache slots of its nodes [m], the mask [m, S] of what each may
        attend to: the real prefix, its ancestors' slots and its own, its cache). Projections,
        MLP and LM head run once over all nodes, attention per request. → (draft-vocab logits
        [M, V_d], prenorm [M, H])."""
        cos, sin = self.rope(positions, h.dtype)
        q, k, v = self.midlayer.qkv(self.embed_in(tokens)[None], h[None], cos, sin)
        outs = []
        for off, slots, mask, cache in rows:
            m = len(slots)
            kc, vc = cache.layers[0]
            kc[0].index_copy_(1, slots, k[0, :, off : off + m])
            vc[0].index_copy_(1, slots, v[0, :, off : off + m])
            end = mask.shape[-1]
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, off : off + m],
                    kc[:, :, :end],
                    vc[:, :, :end],
                    attn_mask=mask,
                    enable_gqa=self.s.kv_heads != self.s.heads,
                )
            )
        out = self.midlayer.finish(torch.cat(outs, dim=2), h[None])[0]
        return self.lm_head(self.norm(out)), out

    def new_cache(self, capacity: int) -> KVCache:
        p = self.fc.weight
        shape = LlamaShape(**{**self.s.__dict__, "layers": 1})
        return KVCache(shape, 1, capacity, p.dtype, p.device)

    # -- checkpoint I/O (published EAGLE-3 layout) ---------------------------------------------
    def save_pretrained(self, path: str | Path, dtype=torch.float16) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            k: (v.to("cpu", dtype) if v.is_floating_point() else v.cpu()).contiguous()
            for k, v in self.state_dict().items()
            if not k.startswith("embed_tokens")
        }
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        self.cfg.dtype = str(dtype).removeprefix("torch.")
        self.cfg.save_pretrained(str(path))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target_embed: torch.Tensor | None = None,
        dtype=torch.float32,
        device="cpu",
        target: LlamaShape | None = None,
    ) -> "Eagle3Head":
        """With ``target``, a head trained for another target raises ``HeadMismatch``."""
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        if "eagle_config" not in raw or "eagle_aux_hidden_state_layer_ids" not in raw["eagle_config"]:
            raise ValueError(f"{path}: config.json lacks eagle_config.eagle_aux_hidden_state_layer_ids")
        if target is not None:
            check_fits(raw, target, path)
        cfg = LlamaConfig.from_pretrained(str(path))
        cfg.eagle_config = raw["eagle_config"]
        with torch.device("meta"):
            head = cls(cfg)
        state = load_file(str(path / "model.safetensors"))
        if "embed_tokens.weight" not in state:
            if target_embed is None:
                raise ValueError(f"{path}: head has no embed_tokens.weight; pass the target's embeddings")
            state["embed_tokens.weight"] = target_embed.detach()
        head.load_state_dict(state, strict=True, assign=True)
        head.remaps_vocab = head.draft_vocab != head.s.vocab or bool(head.d2t.any())
        cos, sin = _rope_tables(cfg, head.s.max_positions)
        head.rope_cos, head.rope_sin = cos, sin
        head.embed_tokens.weight.requires_grad_(False)
        return head.to(device=device, dtype=dtype).eval()


class HeadMismatch(ValueError):
    """The head was trained for another target (hidden size, vocabulary or feature layers)."""


def check_fits(raw: dict, target: LlamaShape, path) -> None:
    """A head serves only a target of its hidden size and vocabulary with its feature layers."""
    hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
    layers = raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if (
        hidden != target.hidden
        or raw.get("vocab_size") != target.vocab
        or not all(0 <= i < target.layers for i in layers)
    ):
        raise HeadMismatch(
            f"EAGLE-3 head {path} was trained for a target of hidden {hidden}, vocabulary "
            f"{raw.get('vocab_size')}, feature layers {layers}; this target has hidden "
            f"{target.hidden}, vocabulary {target.vocab}, {target.layers} layers"
        )


def eagle3_config(
    target_cfg, aux_layers: tuple[int, int, int], intermediate: int | None = None, draft_vocab: int | None = None
):
    """Head config for ``target_cfg``: same hidden size, heads, vocabulary and RoPE as the
    target; the LM head covers ``draft_vocab`` tokens (default: the whole vocabulary)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=target_cfg.vocab_size,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate or target_cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=getattr(target_cfg, "num_key_value_heads", None) or target_cfg.num_attention_heads,
        max_position_embeddings=target_cfg.max_position_embeddings,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_parameters=getattr(target_cfg, "rope_parameters", None),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3"],
    )
    cfg.draft_vocab_size = draft_vocab or target_cfg.vocab_size
    cfg.target_hidden_size = target_cfg.hidden_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    return cfg
