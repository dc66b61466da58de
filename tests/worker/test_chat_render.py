"""Chat templates rendered by substitution (``worker.request.chat_render``) give exactly what the
template gives, and a template that transforms content or refuses a shape is still rendered by
the template itself."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from worker.request.chat_render import ChatRenderer

CONVERSATIONS = [
    [{"role": "user", "content": "One word about the sea (#0)."}],
    [{"role": "user", "content": "  edges \n"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi é <|im_end|> {{ x }}"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "with a name", "name": "bob"}],  # not a plain shape: the template renders it
]


def _template(tokenizer, conversations):
    return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)


def test_substitution_equals_the_template_on_smollm2(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    renderer = ChatRenderer(tokenizer)
    assert renderer.render_many(CONVERSATIONS) == _template(tokenizer, CONVERSATIONS)
    # The plain shapes were taken by substitution (cut once), the others were not.
    assert renderer._parts[("user",)] is not None and renderer._parts[("system", "user")] is not None
    assert len(renderer._parts) == 3


@pytest.mark.parametrize("template, transforms", [
    ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}<assistant>", True),
    ("{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] }}</s>{% endfor %}", True),
    ("{% for m in messages %}{{ m.content | length }}:{{ m.content }}|{% endfor %}", True),
    ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]", False),
])
def test_a_template_that_transforms_content_is_rendered_by_itself(tiny_model_dir, template, transforms):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer)
    convs = [[{"role": "user", "content": "  padded </think> text  "}], [{"role": "user", "content": "x"}]]
    assert renderer.render_many(convs) == _template(tokenizer, convs)
    assert (renderer._parts[("user",)] is None) == transforms


def test_a_shape_the_template_refuses_raises_as_the_template_does(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' and loop.first %}"
                               "{{ raise_exception('starts with the user') }}{% endif %}{{ m.content }}{% endfor %}")
    renderer = ChatRenderer(tokenizer)
    assert renderer.render_many([[{"role": "user", "content": "ok"}]]) == ["ok"]
    with pytest.raises(Exception, match="starts with the user"):
        renderer.render_many([[{"role": "assistant", "content": "no"}]])
    assert renderer._parts[("assistant",)] is None
