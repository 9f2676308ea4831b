#!/usr/bin/env python3
"""Golden data for tests/model/test_tokenizer.c and tests/model/test_chat.c.

Every expected value here comes from a reference implementation:

  byte-level BPE   Hugging Face `tokenizers`, configured exactly like each
                   family's real tokenizer.json (normalizer, pre_tokenizer,
                   BPE flags), with the vocabulary and merges of the default
                   model (SmolLM2-135M-Instruct). The families:
                     smollm     Sequence[Digits(individual_digits), ByteLevel(use_regex)]
                                (SmolLM/SmolLM2, StarCoder)
                     gpt2       ByteLevel(use_regex) (GPT-2)
                     llama-bpe  Sequence[Split(Llama-3 regex, Isolated), ByteLevel(no regex)],
                                BPE ignore_merges=True (Meta-Llama-3)
                     qwen2      NFC normalizer, Sequence[Split(Qwen2 regex, Isolated),
                                ByteLevel(no regex)] (Qwen2/Qwen2.5)
                   Control tokens are AddedTokens (special, not normalized).
                   Note: transformers' own GGUF loader (AutoTokenizer.from_pretrained(
                   gguf_file=...)) builds SmolLM2 with a plain ByteLevel pre-tokenizer and
                   loses the Digits step, so it is NOT the reference; the script reports
                   how many corpus entries it gets wrong, for the record.
  SentencePiece    the `sentencepiece` package, on a small BPE model with byte
                   fallback that this script trains on LoCoMo text (conversations
                   26, 30, 41, 42, 43) and converts to tests/golden/tokenizer_spm.gguf.
                   With parse_special, control tokens are split out first and each text
                   fragment is encoded by sentencepiece on its own (with its dummy
                   prefix), which is what HF's legacy slow LlamaTokenizer and llama.cpp
                   do; transformers 5 no longer ships a slow sentencepiece tokenizer.
  chat templates   transformers' render_jinja_template (jinja2 in transformers'
                   sandbox) on the real template strings: SmolLM2's from the GGUF,
                   the others copied below from their public tokenizer_config.json.

Text that is not valid UTF-8 cannot be given to either reference (both take
Python str). The C tokenizer replaces each ill-formed sequence by U+FFFD the
way bytes.decode("utf-8", "replace") does, so for those entries the expected
ids are the reference's ids for that decoded string.

Inputs: tests/golden/tokenizer_corpus.json (hand-written cases) plus LoCoMo
conversation 47 text (held out from SPM training). Outputs in tests/golden/:
tokenizer_bpe.json, tokenizer_tiny.json (a hand-made vocabulary with entries
merges cannot reach), tokenizer_spm.json, tokenizer_spm.gguf,
tokenizer_chat.json, tokenizer_chat_*.gguf.

Usage: python3 tools/make_tokenizer_golden.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import argparse
import io
import json
import os
import sys
import unicodedata

import gguf
import sentencepiece as spm
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
LOCOMO = os.path.join(ROOT, "..", "shared", "data", "locomo")
if not os.path.isdir(LOCOMO):
    LOCOMO = "/work/shared/data/locomo"

# Split patterns of the real tokenizer.json files.
RE_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

FAMILIES = ["smollm", "gpt2", "llama-bpe", "qwen2"]

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


# ---------------------------------------------------------------- GGUF vocab

def field_str_array(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def read_bpe_vocab(path):
    r = gguf.GGUFReader(path)
    tokens = field_str_array(r, "tokenizer.ggml.tokens")
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    merges = [tuple(m.split(" ", 1)) for m in field_str_array(r, "tokenizer.ggml.merges")]
    f = r.fields["tokenizer.chat_template"]
    template = bytes(f.parts[f.data[0]]).decode("utf-8")

    def tok_id(key):
        f = r.fields[key]
        return int(f.parts[f.data[0]][0])
    return tokens, types, merges, template, tok_id("tokenizer.ggml.bos_token_id"), tok_id("tokenizer.ggml.eos_token_id")


def build_hf_bpe(tokens, types, merges, family):
    assert len(set(tokens)) == len(tokens), "duplicate vocab strings"
    vocab = {s: i for i, s in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=(family == "llama-bpe")))
    bl_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    bl_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if family == "gpt2":
        tok.pre_tokenizer = bl_regex
    elif family == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bl_regex])
    elif family == "llama-bpe":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(RE_LLAMA3), behavior="isolated", invert=False), bl_plain])
    elif family == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(RE_QWEN2), behavior="isolated", invert=False), bl_plain])
    else:
        raise ValueError(family)
    added = []
    for i, (s, t) in enumerate(zip(tokens, types)):
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            added.append(AddedToken(s, special=(t != TOKEN_USER_DEFINED), normalized=False,
                                    lstrip=False, rstrip=False, single_word=False))
    tok.add_special_tokens(added)
    return tok


def hf_encode(tok, text, parse_special):
    tok.encode_special_tokens = not parse_special
    return tok.encode(text, add_special_tokens=False).ids


def gpt2_alphabet():
    """GPT-2's bytes_to_unicode(): byte -> printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_bpe():
    """A hand-made vocabulary where some entries cannot be reached by merges
    (Llama 3's tiktoken-derived vocabulary has such entries, SmolLM2's has
    none), so BPE ignore_merges (llama-bpe) changes the result."""
    alpha = gpt2_alphabet()
    tokens = [alpha[b] for b in range(256)] + ["bc", "ab", "abc", "\u0120a", "\u0120abc", "<|ctl|>"]
    types = [TOKEN_NORMAL] * (len(tokens) - 1) + [TOKEN_CONTROL]
    merges = [("b", "c"), ("a", "b"), ("\u0120", "a")]
    texts = ["abc", " abc", "abcabc", "xabc ab bc", "<|ctl|>abc abc", "ab c", "abc\n abc  abc"]
    return tokens, types, merges, texts


# ---------------------------------------------------------------- corpus

def locomo_turns(conv):
    d = json.load(open(os.path.join(LOCOMO, conv + ".json")))
    out = []
    for k in sorted((k for k in d if k.startswith("session_") and isinstance(d[k], list)),
                    key=lambda k: int(k.split("_")[1])):
        for turn in d[k]:
            out.append(turn["speaker"] + ": " + turn["text"])
    return out


def load_corpus():
    entries = json.load(open(os.path.join(GOLDEN, "tokenizer_corpus.json")))["entries"]
    out = []
    for e in entries:
        raw = e["text"].encode("utf-8") if "text" in e else bytes.fromhex(e["hex"])
        out.append((e["name"], raw))
    turns = locomo_turns("47")
    for i in range(0, 40, 4):
        out.append(("locomo47_turn%d" % i, turns[i].encode("utf-8")))
    # About 2,000 tokens: the C test also times this one.
    long = "\n".join(turns[:120])
    out.append(("locomo47_long", long[:9000].encode("utf-8")))
    return out


def as_str(raw):
    return raw.decode("utf-8", "replace")


# ---------------------------------------------------------------- SentencePiece

def spm_train():
    lines = []
    for conv in ["26", "30", "41", "42", "43"]:
        lines += locomo_turns(conv)
    model = io.BytesIO()
    # Llama-2/Mistral-like settings: BPE, byte fallback, identity normalization,
    # spaces kept, dummy prefix, split digits.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=3000,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_write_gguf(sp, path):
    n = sp.vocab_size()
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TOKEN_UNKNOWN)
        elif sp.is_control(i):
            types.append(TOKEN_CONTROL)
        elif sp.is_byte(i):
            types.append(TOKEN_BYTE)
        elif sp.is_unused(i):
            types.append(TOKEN_UNUSED)
        else:
            types.append(TOKEN_NORMAL)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens, types


def spm_encode(sp, tokens, types, text, parse_special):
    if not parse_special:
        return sp.encode(text)
    specials = sorted(((t, i) for i, t in enumerate(tokens) if types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN)),
                      key=lambda x: -len(x[0]))
    ids, frag, i = [], 0, 0
    while i < len(text):
        hit = next(((s, tid) for s, tid in specials if text.startswith(s, i)), None)
        if hit is None:
            i += 1
            continue
        ids += sp.encode(text[frag:i]) if i > frag else []
        ids.append(hit[1])
        i += len(hit[0])
        frag = i
    ids += sp.encode(text[frag:]) if len(text) > frag else []
    return ids


# ---------------------------------------------------------------- chat templates

# meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json
TEMPLATE_LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                   "<|end_header_id|>\n\n' }}{% endif %}")

# meta-llama/Llama-3.1-8B-Instruct (and -70B), tokenizer_config.json
TEMPLATE_LLAMA31 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

# Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json
TEMPLATE_QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# teknium/OpenHermes-2.5-Mistral-7B: ChatML without a default system prompt
TEMPLATE_CHATML_PLAIN = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                         "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                         "{% endif %}")

_MISTRAL_CLASSIC = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
                    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
                    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                    "{{ message['content'] + EOS }}{% else %}{{ raise_exception('Only user and assistant roles "
                    "are supported!') }}{% endif %}{% endfor %}")
# mistralai/Mistral-7B-Instruct-v0.1, first revision: a space after each </s>
TEMPLATE_MISTRAL_V01 = _MISTRAL_CLASSIC.replace("EOS", "eos_token + ' '")
# mistralai/Mistral-7B-Instruct-v0.2 (as in llama.cpp's test-chat-template.cpp)
TEMPLATE_MISTRAL_V02 = _MISTRAL_CLASSIC.replace("EOS", "eos_token")
# mistralai/Mixtral-8x7B-Instruct-v0.1 and Mistral-7B-Instruct v0.1/v0.2, 2024 revision
TEMPLATE_MISTRAL_2024 = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}"""

CONVERSATIONS = [
    ("single_user", [("user", "Hello!")]),
    ("system_turns", [("system", "You are a pirate."), ("user", "Hi"), ("assistant", "Arr, matey!"),
                      ("user", "Where is the treasure?")]),
    ("whitespace", [("user", "  padded question \n"), ("assistant", "\u00a0nbsp answer\u3000 \t"),
                    ("user", "\n\nx\u2003")]),
    ("multiline", [("user", "Line1\nLine2\n\nLine4"), ("assistant", "ok."), ("user", "more <|im_end|> [INST] text")]),
    ("unicode", [("system", " \u65e5\u672c\u8a9e\u306e\u30b7\u30b9\u30c6\u30e0 "), ("user", "\U0001F600 caf\u00e9")]),
    ("not_alternating", [("user", "a"), ("user", "b")]),
    ("assistant_last", [("user", "q"), ("assistant", "  a  ")]),
]


def render(template, msgs, add_gen, bos, eos):
    from transformers.utils.chat_template_utils import render_jinja_template
    conv = [{"role": r, "content": c} for r, c in msgs]
    try:
        out, _ = render_jinja_template(conversations=[conv], chat_template=template,
                                       add_generation_prompt=add_gen, bos_token=bos, eos_token=eos)
        return out[0], None
    except Exception as e:  # raise_exception() in the template
        return None, str(e)


def write_chat_gguf(path, template, bos, eos):
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", bos, eos])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()

    tokens, types, merges, smol_template, smol_bos, smol_eos = read_bpe_vocab(args.model)
    corpus = load_corpus()

    # ---- byte-level BPE
    hf = {f: build_hf_bpe(tokens, types, merges, f) for f in FAMILIES}
    entries = []
    for name, raw in corpus:
        text = as_str(raw)
        e = {"name": name, "hex": raw.hex(), "valid_utf8": text.encode("utf-8") == raw,
             "nfc_stable": unicodedata.normalize("NFC", text) == text, "ids": {}}
        for f in FAMILIES:
            e["ids"][f] = {"special": hf_encode(hf[f], text, True), "plain": hf_encode(hf[f], text, False)}
        entries.append(e)
    bpe = {"generator": "tools/make_tokenizer_golden.py", "model": os.path.basename(args.model),
           "families": FAMILIES, "entries": entries}
    with open(os.path.join(GOLDEN, "tokenizer_bpe.json"), "w") as fp:
        json.dump(bpe, fp, separators=(",", ":"))
    print("tokenizer_bpe.json: %d entries, %d ids" % (
        len(entries), sum(len(v["special"]) + len(v["plain"]) for e in entries for v in e["ids"].values())))

    ttokens, ttypes, tmerges, ttexts = tiny_bpe()
    thf = {f: build_hf_bpe(ttokens, ttypes, tmerges, f) for f in FAMILIES}
    tiny = {"generator": "tools/make_tokenizer_golden.py", "families": FAMILIES, "tokens": ttokens,
            "types": ttypes, "merges": [a + " " + b for a, b in tmerges],
            "entries": [{"name": "tiny%d" % i, "hex": t.encode("utf-8").hex(), "valid_utf8": True,
                         "nfc_stable": True,
                         "ids": {f: {"special": hf_encode(thf[f], t, True), "plain": hf_encode(thf[f], t, False)}
                                 for f in FAMILIES}} for i, t in enumerate(ttexts)]}
    with open(os.path.join(GOLDEN, "tokenizer_tiny.json"), "w") as fp:
        json.dump(tiny, fp, indent=1)

    try:  # for the record: transformers' GGUF loader vs the real SmolLM2 pre-tokenizer
        from transformers import AutoTokenizer
        tf = AutoTokenizer.from_pretrained(os.path.dirname(args.model), gguf_file=os.path.basename(args.model))
        bad = [n for n, raw in corpus
               if tf(as_str(raw), add_special_tokens=False)["input_ids"] != hf_encode(hf["smollm"], as_str(raw), True)]
        print("transformers GGUF loader differs from the real SmolLM2 tokenizer on %d entries: %s" % (len(bad), bad))
    except Exception as ex:  # informative only
        print("transformers GGUF loader not checked:", ex)

    # ---- SentencePiece
    sp = spm_train()
    spm_path = os.path.join(GOLDEN, "tokenizer_spm.gguf")
    sp_tokens, sp_types = spm_write_gguf(sp, spm_path)
    sentries = []
    for name, raw in corpus:
        text = as_str(raw)
        sentries.append({"name": name, "hex": raw.hex(), "valid_utf8": text.encode("utf-8") == raw,
                         "ids": {"special": spm_encode(sp, sp_tokens, sp_types, text, True),
                                 "plain": spm_encode(sp, sp_tokens, sp_types, text, False)}})
    with open(os.path.join(GOLDEN, "tokenizer_spm.json"), "w") as fp:
        json.dump({"generator": "tools/make_tokenizer_golden.py", "gguf": "tokenizer_spm.gguf",
                   "entries": sentries}, fp, separators=(",", ":"))
    print("tokenizer_spm.gguf: %d bytes, vocab %d" % (os.path.getsize(spm_path), sp.vocab_size()))

    # ---- chat templates
    templates = [
        # name, kind, template, bos, eos, gguf file (None: the default model)
        ("smollm2", "chatml", smol_template, tokens[smol_bos], tokens[smol_eos], None),
        ("chatml_plain", "chatml", TEMPLATE_CHATML_PLAIN, "<s>", "</s>", "tokenizer_chat_chatml_plain.gguf"),
        ("qwen2.5", "chatml", TEMPLATE_QWEN25, "<|endoftext|>", "<|im_end|>", "tokenizer_chat_qwen25.gguf"),
        ("llama3", "llama3", TEMPLATE_LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "tokenizer_chat_llama3.gguf"),
        ("llama3.1", "llama3", TEMPLATE_LLAMA31, "<|begin_of_text|>", "<|eot_id|>", "tokenizer_chat_llama31.gguf"),
        ("mistral_v0.1", "mistral", TEMPLATE_MISTRAL_V01, "<s>", "</s>", "tokenizer_chat_mistral_v01.gguf"),
        ("mistral_v0.2", "mistral", TEMPLATE_MISTRAL_V02, "<s>", "</s>", "tokenizer_chat_mistral_v02.gguf"),
        ("mistral_2024", "mistral", TEMPLATE_MISTRAL_2024, "<s>", "</s>", "tokenizer_chat_mistral_2024.gguf"),
    ]
    cases = []
    for tname, kind, tmpl, bos, eos, gfile in templates:
        if gfile:
            write_chat_gguf(os.path.join(GOLDEN, gfile), tmpl, bos, eos)
        for cname, msgs in CONVERSATIONS:
            for add_gen in (False, True):
                out, err = render(tmpl, msgs, add_gen, bos, eos)
                cases.append({"template": tname, "conversation": cname, "add_generation_prompt": add_gen,
                              "messages": [{"role": r, "content": c} for r, c in msgs],
                              "expected": out, "error": err})
    with open(os.path.join(GOLDEN, "tokenizer_chat.json"), "w") as fp:
        json.dump({"generator": "tools/make_tokenizer_golden.py",
                   "templates": [{"name": n, "kind": k, "gguf": g} for n, k, _, _, _, g in templates],
                   "cases": cases}, fp, indent=1)
    print("tokenizer_chat.json: %d cases (%d raise in the reference)" % (
        len(cases), sum(1 for c in cases if c["error"])))


if __name__ == "__main__":
    sys.exit(main())
