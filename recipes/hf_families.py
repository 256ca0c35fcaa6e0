"""Which Hugging Face causal-LM families the rewrite accepts at a given tp, and why the others are refused.

For each family a tiny model of random init is built from its config class (no download) and put through
``explain(model, tp)``: the checks the strategy runs before training, the whole-model check included (a small float64
copy called as ``model(input_ids=x, labels=x)``, as is and on emulated tensor-parallel ranks). Prints one row per
family: accepted with the relative difference of the check, or refused with the first sentence of the reason; and
the seconds the checks took.

    python recipes/hf_families.py [--tp 2] [--families llama gemma falcon:new-arch ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "smollm3", "olmo", "granite", "helium", "glm", "ministral",
            "seed_oss", "ernie4_5", "arcee", "gpt2", "gemma2", "gemma3_text", "olmo2", "olmo3", "phi", "phi3",
            "gpt_neox", "falcon", "cohere", "cohere2", "starcoder2", "stablelm", "mixtral", "qwen2_moe", "qwen3_moe",
            "granitemoe", "olmoe", "glm4_moe", "gpt_oss", "nemotron", "persimmon", "gptj", "codegen", "bloom", "opt", "gpt_bigcode"]
VARIANTS = {  # a family's other published layouts, as "model_type:variant": the config settings that make it
    "phi3:no-gqa": dict(num_key_value_heads=4),  # Phi-3-mini: q, k and v of equal sizes
    "falcon:new-arch": dict(new_decoder_architecture=True, num_kv_heads=2),  # Falcon-40B/180B
    "falcon:per-head": dict(multi_query=False),  # one key/value head per query head
    "stablelm:qk-norm": dict(qk_layernorm=True), "cohere:qk-norm": dict(use_qk_norm=True),
}
SIZES = dict(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=64)


def tiny_model(model_type: str):
    """A two-layer model of ``model_type`` (or ``model_type:variant``, :data:`VARIANTS`) with 4 heads of 4 values,
    built from its config class."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type.split(":")[0]]
    sizes = {**SIZES, **VARIANTS.get(model_type, {})}
    try:
        config = config_class(**sizes)
    except AttributeError:  # head_dim derived from the others (a read-only property)
        config = config_class(**{k: v for k, v in sizes.items() if k != "head_dim"})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def row(model_type: str, tp: int) -> tuple[str, str, str]:
    from lightning_seqpar import explain

    try:
        model = tiny_model(model_type)
    except Exception as error:  # noqa: BLE001 - a family this transformers cannot build small: reported
        return model_type, "not built", f"{type(error).__name__}: {str(error)[:90]}"
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            explain(model, tp=tp)
        outcome, reason = "accepted", f"loss and logits within {difference(model, tp):.1e} of one device"
    except Exception as error:  # noqa: BLE001 - the refusal is the result
        outcome = "refused"
        text = str(error)
        marker = "why none is known: "
        reason = text.split(marker)[1].split(". Known blocks")[0] if marker in text else text
    return model_type, outcome, f"{reason[:150]} ({time.perf_counter() - start:.2f} s)"


def difference(model, tp: int) -> float:
    """The whole-model check's relative difference (float64 small copy on ``tp`` emulated ranks, loss and logits)."""
    from lightning_seqpar.hf.model_check import check_causal_lm
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.rewriting import RewriteContext

    def build(small, group):
        rewrite(small, RewriteContext(group, True, None, True), verify=False)
        return small

    return check_causal_lm(model, tp, build, type(model).__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--families", nargs="*", default=FAMILIES + list(VARIANTS))
    args = parser.parse_args()
    from lightning_seqpar.extras import require_extra

    require_extra("hf", "recipes/hf_families.py (Hugging Face families)")  # said before any process starts
    import transformers

    print(f"transformers {transformers.__version__}, tp={args.tp}")
    print("| family | outcome | measured, or why refused (seconds of checks) |\n|---|---|---|")
    for model_type in args.families:
        print("| {} | {} | {} |".format(*row(model_type, args.tp)), flush=True)


if __name__ == "__main__":
    main()
