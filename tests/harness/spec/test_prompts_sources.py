"""--prompts: JSONL token ids, text through the model's own tokenizer, messages through its chat template, and Hub
datasets through the real datasets.load_dataset (from an HF cache laid out as huggingface_hub writes it); every bad
prompt is one error naming its line."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer

from lpdiff.harness.spec.catalog import ZOO_DIR
from lpdiff.harness.spec.prompt_sources import PromptSource
from lpdiff.harness.spec.resolve import SpecError, resolve
from tests.helpers.hf_cache import offline_home, populate

MODEL = "tiny-qwen3-moe"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_token_ids_text_and_messages(monkeypatch, tmp_path):
    offline_home(monkeypatch, tmp_path)
    d = tmp_path / "model"
    shutil.copytree(ZOO_DIR / MODEL, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    f = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"token_ids": [1, 2, 3]},
            {"text": "def add(a, b):\n    return a + b"},
            {"messages": [{"role": "user", "content": "x = 1"}]},
        ],
    )
    r = resolve(str(d), adapters=(), prompts=PromptSource(f))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert r.prompts[0] == [1, 2, 3]
    assert r.prompts[1] == tok.encode("def add(a, b):\n    return a + b").ids  # the model's own tokenizer
    assert r.prompts[2] == tok.encode("<user>x = 1\n").ids  # through its chat template
    assert resolve(str(d), adapters=(), prompts=PromptSource(f, count=1)).prompts == [[1, 2, 3]]
    # the catalog model has the same tokenizer files but no template: messages are refused by name
    with pytest.raises(SpecError, match=r"line 3: .*no chat template"):
        resolve(MODEL, adapters=(), prompts=PromptSource(f))


@pytest.mark.parametrize(
    "row, says",
    [
        ({"token_ids": [1, 5000]}, r"line 2.*5000"),  # out of vocabulary (1024)
        ({"token_ids": []}, r"line 2.*0 token"),
        ({"token_ids": [1.0, 2.0]}, r"line 2.*float"),
        ({"token_ids": [7] * 1025}, r"line 2.*(max_position_embeddings|1024 positions|1025)"),
        ({"text": ""}, r"line 2"),
        ({"tokens": [1, 2]}, r"line 2: expected an object with exactly one of token_ids, text, messages"),
    ],
)
def test_bad_prompt_is_one_error_naming_the_line(tmp_path, row, says):
    f = _jsonl(tmp_path / "bad.jsonl", [{"token_ids": [1, 2]}, row])
    with pytest.raises(ValueError, match=says):
        resolve(MODEL, adapters=(), prompts=PromptSource(f))


def test_not_json_and_wrong_suffix(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"token_ids": [1, 2]}\n{oops\n')
    with pytest.raises(SpecError, match=r"x.jsonl line 2: not JSON"):
        resolve(MODEL, adapters=(), prompts=PromptSource(str(tmp_path / "x.jsonl")))
    with pytest.raises(SpecError, match=r"give a \.jsonl file"):
        PromptSource(str(tmp_path / "x.txt"))


def test_hub_dataset_split_column_count_seed(monkeypatch, tmp_path):
    hub = offline_home(monkeypatch, tmp_path)
    data = tmp_path / "ds"
    (data / "data").mkdir(parents=True)
    _jsonl(data / "data" / "train.jsonl", [{"prompt": f"value = {i} + {i}", "ids": [i + 2, 7, 9]} for i in range(6)])
    _jsonl(data / "data" / "test.jsonl", [{"prompt": "t", "ids": [3, 4]}])
    (data / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: data/train.jsonl\n  - split: test\n    path: data/test.jsonl\n---\n"
    )
    _, commit = populate(hub, "acme/prompts", data, repo_type="dataset")
    tok = Tokenizer.from_file(str(ZOO_DIR / MODEL / "tokenizer.json"))
    src = PromptSource(f"hf://datasets/acme/prompts@{commit}", count=3)
    assert resolve(MODEL, adapters=(), prompts=src).prompts == [tok.encode(f"value = {i} + {i}").ids for i in range(3)]
    ids = resolve(MODEL, adapters=(), prompts=PromptSource("hf://datasets/acme/prompts", column="ids")).prompts
    assert ids == [[i + 2, 7, 9] for i in range(6)]
    shuffled = resolve(
        MODEL, adapters=(), prompts=PromptSource("hf://datasets/acme/prompts", column="ids", seed=1)
    ).prompts
    assert sorted(shuffled) == sorted(ids) and shuffled != ids
    assert resolve(
        MODEL, adapters=(), prompts=PromptSource("hf://datasets/acme/prompts", split="test", column="ids")
    ).prompts == [[3, 4]]
    with pytest.raises(SpecError, match="no column 'nope'; columns: prompt, ids"):
        resolve(MODEL, adapters=(), prompts=PromptSource("hf://datasets/acme/prompts", column="nope"))
    with pytest.raises(SpecError, match="hf download acme/missing --repo-type dataset"):
        resolve(MODEL, adapters=(), prompts=PromptSource("hf://datasets/acme/missing"))


def test_built_in_sets_follow_the_models_own_tokenizer(monkeypatch, tmp_path):
    """The built-in sets are windows of held-out text cut with the zoo tokenizer. A checkpoint whose tokenizer is
    another (here a 512-token BPE trained on the zoo tokenizer's vocabulary list, saved over a copy of the zoo model)
    gets the same text cut with its own: each prompt decodes to a piece of the held-out text (the zoo's ids decoded
    with it were gibberish). A copy with the zoo's tokenizer keeps the zoo's ids, so its baselines stay the zoo's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lpdiff.harness.spec.prompts import DATA_DIR, named_prompts

    offline_home(monkeypatch, tmp_path)
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(ZOO_DIR / MODEL, same)
    shutil.copytree(ZOO_DIR / MODEL, other)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    vocab = Tokenizer.from_file(str(ZOO_DIR / MODEL / "tokenizer.json")).get_vocab()
    words = [w.replace("Ġ", " ").replace("Ċ", "\n") for w in sorted(vocab)]  # no held-out text in the training
    tok.train_from_iterator(
        words * 4, trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.save(str(other / "tokenizer.json"))
    assert resolve(str(same), adapters=()).prompts == named_prompts("default")
    got = resolve(str(other), adapters=()).prompts
    assert [len(p) for p in got] == [len(p) for p in named_prompts("default")] and got != named_prompts("default")
    text = (DATA_DIR / "heldout.txt").read_text(encoding="utf-8")
    assert all(tok.decode(p) in text for p in got)
    assert not any(tok.decode(p) in text for p in named_prompts("default"))  # what the zoo's ids read as there
    long = resolve(str(other), adapters=(), prompts="bench").prompts  # 8 x 512 tokens: fits after reading on
    assert [len(p) for p in long] == [512] * 8 and all(max(p) < 512 for p in long)
