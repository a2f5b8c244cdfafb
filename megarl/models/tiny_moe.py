"""Build the demo's tiny Qwen3-MoE checkpoint offline: a byte-level BPE tokenizer trained on the
task's own text and a randomly initialised model, saved as a normal HF checkpoint directory.

Two variants: the arithmetic demo's (64 positions, :data:`CHAT_TEMPLATE`), and the tool-calling one
(``TinyMoeSpec.tool_calling``: 256 positions, :data:`TOOL_CHAT_TEMPLATE`, a tokenizer trained on the
tool-calling task's rendered episodes, ``megarl/tasks/tool_calling.py``, so that a call is a few tokens).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from megarl.tasks import arithmetic
from megarl.tasks import tool_calling as tool_task

log = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"

# A minimal chat template (rendered from ``messages`` alone; short role tags, for the 64-token context):
# "<|bos|>U:hi\nA:hello<|endoftext|>T:42\nA:" -- an assistant turn ends with EOS, any other role's turn
# with a newline; ``add_generation_prompt`` opens the assistant's turn.
CHAT_TEMPLATE = (
    BOS + "{% for m in messages %}{% if m['role'] == 'assistant' %}A:{{ m['content'] }}" + EOS
    + "{% else %}{{ m['role'][:1] | upper }}:{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)

# The tool-calling variant's template: the same turns, and OpenAI function calling in the Qwen format.
# ``tools`` are listed (one JSON object a line, between <tools> tags) in the system turn, after the system
# message if there is one; an assistant turn writes its content, then each of its ``tool_calls`` as
# ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` (one a line), then EOS; a tool
# message is ``T:<tool_response>\n...\n</tool_response>\n``.
TOOL_CHAT_TEMPLATE = (
    BOS + "{% set system = messages and messages[0]['role'] == 'system' %}"
    "{% if tools or system %}S:{% if system %}{{ messages[0]['content'] }}\n{% endif %}{% if tools %}<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call a tool, answer <tool_call>\n{\"name\": <tool name>, \"arguments\": <JSON object>}\n</tool_call>\n"
    "{% endif %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A:{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if m['content'] or not loop.first %}\n{% endif %}<tool_call>\n{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}\n</tool_call>{% endfor %}" + EOS
    + "{% elif m['role'] == 'tool' %}T:<tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% elif not (loop.first and system) %}{{ m['role'][:1] | upper }}:{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
# What the tool-calling variant changes in the spec unless the recipe's arch says otherwise.
TOOL_CALLING_DEFAULTS = {"vocab_size": 640, "max_position_embeddings": 256}


@dataclass(frozen=True)
class TinyMoeSpec:
    hidden_size: int = 64
    num_layers: int = 2
    num_experts: int = 8
    topk: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    moe_ffn_hidden_size: int = 128
    vocab_size: int = 384  # >= tokenizer size, a multiple of 128 (Megatron's vocab padding unit)
    max_position_embeddings: int = 64
    seed: int = 0
    tool_calling: bool = False  # the tool-calling variant's tokenizer and chat template (module docstring)
    tie_word_embeddings: bool = False  # the output projection is the embedding table (one tensor)

    @classmethod
    def from_arch(cls, arch, tool_calling: bool = False) -> "TinyMoeSpec":
        """The spec a recipe's ``model.arch`` describes (fields left ``None`` keep their default, for the
        tool-calling variant :data:`TOOL_CALLING_DEFAULTS` first)."""
        names = {"hidden_size": "hidden_size", "num_layers": "num_layers", "num_experts": "num_experts",
                 "topk": "moe_topk", "num_heads": "num_attention_heads", "num_kv_heads": "num_query_groups",
                 "moe_ffn_hidden_size": "moe_ffn_hidden_size", "vocab_size": "vocab_size"}
        given = {mine: getattr(arch, theirs) for mine, theirs in names.items() if getattr(arch, theirs) is not None}
        variant = {**TOOL_CALLING_DEFAULTS, "tool_calling": True} if tool_calling else {}
        return cls(**{**variant, **given})


def train_tokenizer(texts: list[str], chat_template: str = CHAT_TEMPLATE, vocab_size: int = 512,
                    words: bool = True):
    """Byte-level BPE over ``texts`` (at most ``vocab_size`` tokens); digits are split individually so
    numbers tokenize per digit. ``words``: tokens never span a word boundary (GPT-2's split); False:
    only digits split the text, so that text repeated between numbers (a chat template's, a tool
    call's) can become one token.

    Returns a transformers ``PreTrainedTokenizerFast`` that prepends BOS to every encoded text, with
    ``chat_template`` as its chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=words)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=chat_template)


def tool_calling_corpus(max_operand: int) -> list[str]:
    """The pieces of every episode of the tool-calling task (each problem answered at once and through
    the tool, rendered by :data:`TOOL_CHAT_TEMPLATE`): what its tokenizer is trained on."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return render_jinja_template([messages], tools=tool_task.TOOLS, chat_template=TOOL_CHAT_TEMPLATE,
                                     add_generation_prompt=add_generation_prompt)[0][0]

    return [text for problem in arithmetic.all_problems(max_operand) for use_tool in (False, True)
            for text, _ in tool_task.transcript(render, problem, use_tool)]


def make_tiny_moe(out_dir: str | Path, spec: TinyMoeSpec = TinyMoeSpec(), max_operand: int = 9) -> Path:
    """Write tokenizer + random-init Qwen3-MoE (float32 safetensors) to ``out_dir``; returns it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if spec.tool_calling:
        tokenizer = train_tokenizer(tool_calling_corpus(max_operand), TOOL_CHAT_TEMPLATE, spec.vocab_size, words=False)
    else:
        tokenizer = train_tokenizer(arithmetic.corpus(max_operand))
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={spec.vocab_size}")
    head_dim = spec.hidden_size // spec.num_heads
    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=4 * spec.hidden_size,
        moe_intermediate_size=spec.moe_ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=head_dim,
        num_experts=spec.num_experts, num_experts_per_tok=spec.topk, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    log.info("tiny MoE: %d parameters, %d tokens -> %s", sum(p.numel() for p in model.parameters()), len(tokenizer),
             out)
    return out
