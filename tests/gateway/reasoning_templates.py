"""Chat templates of reasoning models, written small, for the reasoning tests (nothing can be
downloaded here): each keeps what its model's real template does with thinking.

- QWEN3: Qwen3's: the model opens `<think>` itself; `enable_thinking: false` writes an empty
  block into the prompt; an assistant turn's `reasoning_content` is shown only for the turns
  after the last user message (and its `</think>`-split content otherwise).
- DEEPSEEK_R1: DeepSeek-R1's (0528): the generation prompt opens `<think>\\n`; earlier turns lose
  their thinking (the template keeps what follows `</think>`).
- MAGISTRAL: Mistral's Magistral: a system prompt that names [THINK]...[/THINK]; [THINK] and
  [/THINK] are special tokens.
- GPT_OSS: gpt-oss's harmony: `reasoning_effort` in the system message, an assistant turn's
  `thinking` in the analysis channel, the generation prompt `<|start|>assistant`."""

QWEN3 = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- if '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{{ content + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif -%}"
    "{%- endif -%}")

DEEPSEEK_R1 = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif -%}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif -%}")

MAGISTRAL = (
    "{{ '[SYSTEM_PROMPT]First draft your thinking process until you arrive at a response, as '"
    " + '[THINK]your thoughts[/THINK]then the response.[/SYSTEM_PROMPT]' }}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' %}{{ '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{ m.content + '<|im_end|>' }}{% endif -%}"
    "{%- endfor -%}")
MAGISTRAL_SPECIAL = ("[THINK]", "[/THINK]", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")

GPT_OSS = (
    "{{ '<|start|>system<|message|>Reasoning: ' + (reasoning_effort | default('medium')) + '<|end|>' }}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.thinking and m.tool_calls is defined -%}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif -%}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif -%}")
HARMONY_SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
