"""Tiny Hugging Face causal LMs (random init, built from a config: nothing is downloaded)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from tests.helpers.models import SEQ, VOCAB

WINDOW = 3
"""The sliding window of the windowed families: shorter than the sequence, so it masks."""

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"all": (SEVEN, False),  # B drawn too (PEFT's init_lora_weights=False): every adapter has a gradient at once
        "default": (SEVEN, True),  # PEFT's default: B = 0
        "attention": (["q_proj", "v_proj"], False),
        "rows": (["o_proj", "down_proj"], False),  # row-parallel only: adapters that add no communication
        "experts": (["q_proj", "v_proj"], False),  # and a mixture's packed experts: EXPERT_PARAMETERS
        "all-linear": ("all-linear", False),  # PEFT's choice per family (routers and experts of most mixtures)
        "all-linear+experts": ("all-linear", False)}  # and the experts in every family: what FineTuneModule asks
"""``lora=`` of :class:`HFCausalLM`: (target_modules, init_lora_weights) of a LoraConfig(r=2, lora_alpha=4)."""

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""PEFT's ``target_parameters`` of ``lora="experts"``: both packed projections of every mixture's experts."""


MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss", "granitemoe")
"""The mixture-of-experts families: 8 experts of width 8, top-2."""


def moe_config(family: str, common: dict, aux: float = 0.0):
    """A tiny config of a mixture-of-experts ``family`` (:data:`MOE`): every layer a mixture of 8 experts, top-2;
    Qwen2-MoE with its gated shared expert, GLM-4.5 with its shared expert, sigmoid group-limited routing and a first
    dense layer. ``aux > 0``: ``output_router_logits=True`` with ``router_aux_loss_coef=aux`` (the load-balancing loss
    in ``.loss``)."""
    import transformers

    moe = dict(common, intermediate_size=32)
    if aux:
        moe.update(output_router_logits=True, router_aux_loss_coef=aux)
    if family == "qwen3_moe":  # softmax top-k, normalized
        return transformers.Qwen3MoeConfig(**moe, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True)
    if family == "qwen2_moe":  # + a shared expert scaled by sigmoid(shared_expert_gate(x)); top-k not normalized
        return transformers.Qwen2MoeConfig(**moe, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                                           num_experts=8, num_experts_per_tok=2, use_sliding_window=False)
    if family == "mixtral":  # softmax in float32, top-k normalized
        return transformers.MixtralConfig(**dict(moe, intermediate_size=8), num_local_experts=8, num_experts_per_tok=2,
                                          sliding_window=None)
    if family == "olmoe":  # q/k norms over all heads, top-k not normalized
        return transformers.OlmoeConfig(**dict(moe, intermediate_size=8), num_experts=8, num_experts_per_tok=2,
                                        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "gpt_oss":  # router bias; experts [E, h, 2f] with biases, gate/up interleaved and clamped (a limit
        # small enough to clamp); attention sinks and biases; sliding-window and full layers alternating
        layers = moe["num_hidden_layers"]
        return transformers.GptOssConfig(**dict(moe, intermediate_size=8), head_dim=4, num_local_experts=8,
                                         num_experts_per_tok=2, swiglu_limit=0.05, sliding_window=WINDOW,
                                         rope_parameters=dict(rope_type="yarn", factor=2.0, beta_fast=32.0, beta_slow=1.0,
                                                              truncate=False, original_max_position_embeddings=SEQ),
                                         layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if family == "granitemoe":  # the mixture at block_sparse_moe; Granite's multipliers
        return transformers.GraniteMoeConfig(**dict(moe, intermediate_size=8), num_local_experts=8, num_experts_per_tok=2,
                                             residual_multiplier=0.5, embedding_multiplier=3.0, attention_multiplier=0.3,
                                             logits_scaling=2.0)
    # glm4_moe: sigmoid scores, correction bias, 2 groups of which 1 is chosen, a routed scaling factor, a shared expert
    return transformers.Glm4MoeConfig(**moe, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
                                      n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                      routed_scaling_factor=2.5, pad_token_id=None, bos_token_id=None,
                                      eos_token_id=None)


class HFCausalLM(pl.LightningModule):
    """A user's module around ``AutoModelForCausalLM.from_config``: the loss from ``labels=`` (Hugging Face shifts
    the labels inside the model) or a hand-written cross entropy on the returned logits."""

    def __init__(self, family: str = "llama", attn_implementation: str = "eager", labels: bool = False,
                 kv_heads: int = 2, bias: bool = False, tie: bool = False, layers: int = 2, padding: bool = False,
                 position_offset: int = 0, parallel_residual: bool = True, qk_norm: bool = False,
                 ignored_labels: str = "", documents: bool = False, lora: str = "", aux: float = 0.0,
                 freeze_router: bool = False, optimizer: str = "adamw") -> None:
        super().__init__()
        import transformers

        common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=2 * SEQ,
                      tie_word_embeddings=tie, attn_implementation=attn_implementation)
        full_attention = dict(sliding_window=None, layer_types=["full_attention"] * layers)
        if family == "llama":
            config = transformers.LlamaConfig(attention_bias=bias, **common)
        elif family == "qwen3":  # per-head q/k RMSNorms
            config = transformers.Qwen3Config(attention_bias=bias, **common, **full_attention)
        elif family == "mistral":  # full attention (no sliding window)
            config = transformers.MistralConfig(**common, sliding_window=None)
        elif family == "mistral_window":  # a sliding window shorter than the sequence, on every layer
            config = transformers.MistralConfig(**common, sliding_window=WINDOW)
        elif family == "qwen2_window":  # full and sliding-window layers mixed (use_sliding_window, max_window_layers)
            config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1)
        elif family == "gemma2":  # norms around both branches, soft-capped attention and final logits, windows
            config = transformers.Gemma2Config(head_dim=4, query_pre_attn_scalar=2, sliding_window=WINDOW,
                                               attn_logit_softcapping=0.5, final_logit_softcapping=0.5, **common)
        elif family == "cohere":  # parallel residual from one norm, logit scale (kept vocabulary-parallel)
            config = transformers.CohereConfig(logit_scale=0.5, use_qk_norm=qk_norm, **common)  # q/k norms: [a, d]
        elif family == "cohere2":  # cohere with sliding-window layers that alone take rotary embeddings
            config = transformers.Cohere2Config(logit_scale=0.5, sliding_window=WINDOW,
                                                layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                                **common)
        elif family == "stablelm":  # partial rotary (half of each head), LayerNorms with bias
            config = transformers.StableLmConfig(**common, partial_rotary_factor=0.5, qk_layernorm=qk_norm)  # per head
        elif family == "phi":  # one norm (parallel residual), dense / fc1 / fc2, partial rotary, a bias on the head
            config = transformers.PhiConfig(**common, resid_pdrop=0.0, embd_pdrop=0.0)
        elif family == "starcoder2":  # Llama's attention, a plain c_fc / c_proj MLP, biases, LayerNorms
            config = transformers.Starcoder2Config(**common)
        elif family == "phi3":  # fused qkv_proj (q, k, v of unequal sizes under grouped-query attention), gate_up_proj
            config = transformers.Phi3Config(**common, resid_pdrop=0.0, embd_pdrop=0.0,
                                             pad_token_id=None, bos_token_id=None, eos_token_id=None)
        elif family == "glm":  # fused gate_up_proj, partial rotary
            config = transformers.GlmConfig(**common, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        elif family == "gpt_neox":  # per-head fused query_key_value, partial rotary, parallel residual of two norms
            config = transformers.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                                use_parallel_residual=parallel_residual, hidden_dropout=0.0,
                                                pad_token_id=None, bos_token_id=None, eos_token_id=None)
        elif family == "olmo2":  # norms after attention and MLP only, q/k norms over all heads (summed over tp)
            config = transformers.Olmo2Config(**common, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        elif family == "gemma3":  # Gemma 2's norms, per-head q/k norms, local and global rotary tables, windows
            config = transformers.Gemma3TextConfig(head_dim=4, query_pre_attn_scalar=2, sliding_window=WINDOW,
                                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                                   final_logit_softcapping=0.5, **common)
        elif family.startswith("falcon"):  # fused query_key_value in Falcon's three layouts, a (hidden, None) output
            layout = {"falcon": dict(new_decoder_architecture=True, num_kv_heads=kv_heads),  # grouped per k/v head, 2 norms
                      "falcon_sequential": dict(multi_query=False, parallel_attn=False),  # [q_h; k_h; v_h], 2 norms
                      "falcon_multi_query": dict(multi_query=True)}[family]  # [q; k; v], one k/v head, parallel
            config = transformers.FalconConfig(**{k: v for k, v in common.items() if k not in (
                "intermediate_size", "num_key_value_heads")}, **layout, pad_token_id=None, bos_token_id=None,
                eos_token_id=None)
        elif family == "olmo":  # Llama's parts, q/k/v clipped in its forward: caught by the self-check
            config = transformers.OlmoConfig(clip_qkv=0.5, **common)
        elif family == "gemma":  # the Llama layout's parts; the embedding scaled by √h, norms (1 + w), gelu-tanh
            config = transformers.GemmaConfig(head_dim=4, **common)
        elif family == "smollm3":  # every other layer without rotary embeddings (NoPE), as in SmolLM3's layout
            config = transformers.SmolLM3Config(**common, no_rope_layers=[int(i % 2 == 0) for i in range(layers)],
                                                pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                                **full_attention)
        elif family == "granite":  # multipliers of the embedding, the residual branches, the scores and the logits
            config = transformers.GraniteConfig(residual_multiplier=0.5, embedding_multiplier=3.0,
                                                attention_multiplier=0.3, logits_scaling=2.0, **common)
        elif family == "gpt2":  # fused c_attn, Conv1D weights [in, out], learned positions, tied LM head
            config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=layers, n_head=4,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                attn_implementation=attn_implementation)
        elif family in MOE:  # aux: the load-balancing loss's coefficient (0: the config's default, not computed)
            config = moe_config(family, common, aux)
        else:
            config = transformers.Qwen2Config(**common)
        # The one-process reference runs in float64: transformers' default grouped_mm experts take float32 or bfloat16
        # only, so the experts of the reference run one by one (what "eager" computes is the same function).
        self.model = transformers.AutoModelForCausalLM.from_config(
            config, **({"experts_implementation": "eager"} if family in MOE else {}))
        if freeze_router:  # a mixture's routers kept as they are (FineTuneModule(freeze_router=True))
            from lightning_seqpar.hf.layouts import freeze_routers

            assert freeze_routers(self.model)
        if lora:
            from peft import LoraConfig, get_peft_model

            targets, init = LORA[lora]
            experts = EXPERT_PARAMETERS if lora in ("experts", "all-linear+experts") else None
            self.model = get_peft_model(self.model, LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                                               target_parameters=experts, init_lora_weights=init))
        self.labels, self.optimizer = labels, optimizer
        self.padding, self.position_offset = padding, position_offset
        self.ignored_labels, self.documents = ignored_labels, documents

    def _inputs(self, x: torch.Tensor) -> dict:
        """``input_ids``, and what the module was asked to add: a padding ``attention_mask`` (the last 3 tokens of
        the first sequence of each batch are padding) and ``position_ids`` starting at ``position_offset``."""
        inputs = {"input_ids": x}
        if self.padding:
            mask = torch.ones_like(x)
            mask[0, -3:] = 0
            inputs["attention_mask"] = mask
        if self.position_offset:
            inputs["position_ids"] = torch.arange(x.shape[1], device=x.device).expand_as(x) + self.position_offset
        if self.documents:  # packed rows (DataCollatorWithFlattening): documents of 3 and 5 tokens, then 6 and 2
            s = x.shape[1]
            patterns = torch.stack([torch.cat([torch.arange(e - b) for b, e in zip(row, row[1:] + [s])])
                                    for row in ([0, 3], [0, 6])]).to(x.device)  # [2, s]
            # Chosen by the row's content, so a pipeline's micro-batches see the documents one process sees; by
            # indexing, not int(): no host sync in the step (tests/lightning/test_host_syncs.py).
            positions = patterns[x[:, 0] % 2]
            inputs["position_ids"] = positions
            if type(getattr(self._trainer, "strategy", None)).__name__ != "SeqParallelStrategy":
                # One process, unparallelized: transformers' eager and SDPA kernels attend across documents given
                # position_ids alone, so the reference says where each document ends with a 4-D additive mask.
                documents = (positions == 0).cumsum(-1)
                i = torch.arange(s, device=x.device)
                allowed = (i[:, None] >= i[None, :])[None] & (documents[:, :, None] == documents[:, None, :])
                dtype = self.model.get_input_embeddings().weight.dtype
                inputs["attention_mask"] = torch.zeros(allowed.shape, dtype=dtype).masked_fill(
                    ~allowed, float("-inf"))[:, None]
        return inputs

    def _labels(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y``, with ``-100`` where the module was asked: at padding (``"padding"``: what collators do) or on most
        of the first row (``"uneven"``: context-parallel ranks then hold different numbers of supervised tokens)."""
        if self.ignored_labels == "padding":
            return y.masked_fill(self._inputs(x)["attention_mask"] == 0, -100)
        if self.ignored_labels == "uneven":
            y = y.clone()
            y[0, : 3 * y.shape[1] // 4] = -100
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**self._inputs(x)).logits  # [b, s, v], batch-first as on one device; default use_cache

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.labels:
            return self.model(**self._inputs(x), labels=self._labels(x, y)).loss
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(*batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.compute_loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "muon":  # lightning_seqpar.optim.Muon: the layers' matrices, AdamW over the rest
            from lightning_seqpar.optim import Muon

            return Muon(Muon.groups(self.model), lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
