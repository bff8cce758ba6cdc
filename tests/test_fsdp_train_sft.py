"""Chat SFT and document masking: assistant-only labels from real-style templates, packing that never lets one
document attend to another, and real 2-process training runs on conversations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_lib.data.cache import PackedBlocks
from fsdp_lib.data.chat import ChatEncoder
from tests.fsdp_helpers import (
    CHAT_TEMPLATES,
    arithmetic_conversations,
    killed_at_step,
    losses_by_step,
    make_chat_dataset,
    make_chat_model,
    output_of,
    read_metrics,
    run_trainer,
    tiny_config,
    trainer_args,
)

# What each fixture template renders for an assistant turn with content C (the tokens that must carry loss).
ASSISTANT_SPANS = {
    "llama3": lambda c: c.strip() + "<|eot_id|>",
    "qwen2.5": lambda c: c + "<|im_end|>\n",
    "mistral": lambda c: " " + c + "<|eos|>",
    "gemma": lambda c: c.strip() + "<end_of_turn>\n",
}
CHAT_TEMPLATE_NAMES = [*ASSISTANT_SPANS, "qwen3"]
NO_SYSTEM_ROLE = {"mistral", "gemma"}


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_models")
    return {name: make_chat_model(root / name, name) for name in CHAT_TEMPLATE_NAMES}


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# --- assistant-only labels -------------------------------------------------------------------------


@pytest.mark.parametrize("template", sorted(ASSISTANT_SPANS))
def test_trained_tokens_are_exactly_the_assistant_turns(template, chat_models):
    tokenizer = _tokenizer(chat_models[template])
    conversations = arithmetic_conversations(6, system=template not in NO_SYSTEM_ROLE)
    skipped: dict[str, int] = {}
    encoded = ChatEncoder(tokenizer, "assistant").encode(conversations, skipped)
    assert not skipped and len(encoded) == len(conversations)
    for conversation, (ids, mask) in zip(conversations, encoded):
        ids = np.asarray(ids)
        expected = "".join(ASSISTANT_SPANS[template](t["content"]) for t in conversation if t["role"] == "assistant")
        assert tokenizer.decode(ids[mask == 1]) == expected
        # the masked tokens are one run per assistant turn, and everything else renders the prompts
        assert np.count_nonzero(np.diff(np.concatenate([[0], mask, [0]])) == 1) == sum(
            t["role"] == "assistant" for t in conversation
        )
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tokenize=False)


@pytest.mark.parametrize("template", sorted(ASSISTANT_SPANS))
def test_datasets_made_elsewhere_train_as_data_hf_would_have_stored_them(template, chat_models):
    """A `messages` dataset made without data_hf.py (save_to_disk, the hub): content as a list of parts trained the
    list's repr ("[{'type': 'text', 'text': '3.'}]<|eot_id|>", exit 0), ShareGPT's human/gpt roles were skipped as
    having no assistant turn, and an empty reply among others taught an empty answer. Parts are joined as data_hf.py
    joins them, roles mapped as it maps them, the empty reply is context; content that is no text is a counted skip."""
    tokenizer = _tokenizer(chat_models[template])
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is 1 plus 2?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is"}, {"type": "text", "text": "3."}]},
    ]
    aliases = [{"role": "human", "content": "What is 1 plus 2?"}, {"role": "GPT", "content": "3."}]
    empty_first = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "What is 1 plus 2?"},
        {"role": "assistant", "content": "3."},
    ]
    image = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}}]},
        {"role": "assistant", "content": "A cat."},
    ]
    weighted = [  # OpenAI's weight 0: context (as data_hf.py stores it, "0", or as a dataset made elsewhere has it)
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello.", "weight": "0"},
        {"role": "user", "content": "What is 1 plus 2?"},
        {"role": "assistant", "content": "3.", "weight": 1},
    ]
    all_out = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello.", "weight": 0}]
    halved = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello.", "weight": 0.5}]
    null = [{"role": "user", "content": None}, {"role": "assistant", "content": "Hello."}]  # the template raised
    skipped: dict[str, int] = {}
    encoder = ChatEncoder(tokenizer, "assistant")
    encoded = encoder.encode([parts, aliases, empty_first, image, weighted, all_out, halved, null], skipped)
    span = ASSISTANT_SPANS[template]
    expected = [span("It is\n3."), span("3."), span("3."), span("3.")]
    assert [tokenizer.decode(np.asarray(ids)[mask == 1]) for ids, mask in encoded] == expected
    assert skipped == {
        "content that is not text (non_text_content; data_hf.py --format chat skips and counts these)": 1,
        "content that is not text (non_string_content; data_hf.py --format chat skips and counts these)": 1,
        "every assistant turn has weight 0: nothing to train": 1,
        "a turn weight other than 0 or 1 (0.5; OpenAI's format)": 1,
    }
    said = tokenizer.decode(encoded[0][0])
    assert "What is 1 plus 2?" in said and "'type'" not in said


def test_a_template_without_a_generation_prompt_is_refused_where_its_header_would_train(chat_models, tmp_path, capsys):
    """A template without an add_generation_prompt branch whose turns open with a header (a ChatML loop, Vicuna's
    USER:/ASSISTANT:) trained the header as part of every reply. Refused, naming the fixes; a template that writes
    the header after each user turn (Mistral's [/INST]) trains exactly the reply, as do the fixture templates and
    configs/chatml.jinja."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.data.chat import chat_encoder, check_generation_prompt
    from fsdp_lib.errors import TrainError

    for template in CHAT_TEMPLATE_NAMES:
        check_generation_prompt(_tokenizer(chat_models[template]), "--dataset-name d")
    tokenizer = _tokenizer(chat_models["qwen2.5"])
    tokenizer.chat_template = (Path(__file__).parents[1] / "configs" / "chatml.jinja").read_text()
    check_generation_prompt(tokenizer, "--dataset-name d")
    loop = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    vicuna = "{% for m in messages %}{{ m.role.upper() + ': ' + m.content + '\\n' }}{% endfor %}"
    for template, header in ((loop, "'<|im_start|>assistant'"), (vicuna, "'ASSISTANT:'")):
        tokenizer.chat_template = template
        with pytest.raises(TrainError, match="--dataset-name d: the chat template renders no generation prompt") as err:
            chat_encoder(TrainConfig(model_name="m"), tokenizer, ["messages"], dataset="d")
        assert header in str(err.value) and "--chat-template" in str(err.value) and "--loss-on all" in str(err.value)
        assert chat_encoder(TrainConfig(model_name="m", loss_on="all"), tokenizer, ["messages"], dataset="d")
        with pytest.raises(TrainError) as err:  # preference pairs: --loss-on does not apply to them
            check_generation_prompt(tokenizer, "--dataset-name d", pairs=True)
        assert "--loss-on" not in str(err.value)
        # a run that began so (before this check) resumes with a warning: either fix would change its data
        check_generation_prompt(tokenizer, "--dataset-name d", resuming=True)
        assert "WARNING: --dataset-name d: the chat template renders no generation prompt" in capsys.readouterr().out
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ 'USER: ' + m.content + '\\nASSISTANT:' }}"
        "{% else %}{{ ' ' + m.content + '</s>' }}{% endif %}{% endfor %}"
    )
    encoder = chat_encoder(TrainConfig(model_name="m"), tokenizer, ["messages"], dataset="d")
    [(ids, mask)] = encoder.encode([[{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}]], {})
    assert tokenizer.decode(np.asarray(ids)[mask == 1]) == " Yo.</s>"
    # DeepSeek-R1's: the generation prompt opens a think block the rendered conversation leaves out, so every
    # conversation was a counted skip ("renders a conversation's start differently") and the run stopped on the
    # skip limit without naming the cause; refused before any data is read, naming the generation prompt's end
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ '<|User|>' + m.content }}{% else %}"
        "{{ '<|Assistant|>' + m.content.split('</think>')[-1] + '</s>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}"
    )
    skipped: dict[str, int] = {}
    assert ChatEncoder(tokenizer, "assistant").encode([[{"role": "user", "content": "Hi."},
                                                        {"role": "assistant", "content": "Yo."}]], skipped) == []  # fmt: skip
    assert "differently" in next(iter(skipped))
    with pytest.raises(TrainError, match=r"generation prompt ends with '<think>\\n', which its render") as err:
        chat_encoder(TrainConfig(model_name="m"), tokenizer, ["messages"], dataset="d")
    assert (
        "DeepSeek-R1" in str(err.value)
        and "--chat-template FILE" in str(err.value)
        and "--loss-on all" in str(err.value)
    )
    check_generation_prompt(tokenizer, "--dataset-name d", resuming=True)
    assert "WARNING: --dataset-name d: the chat template's generation prompt ends with" in capsys.readouterr().out


def test_the_end_of_turn_token_is_a_stop_of_the_exported_generation_config(chat_models, tmp_path):
    """A model fine-tuned with a template whose turns end in a special token other than EOS: the export's
    generation_config.json lists that token among eos_token_id (written from the model's config where none was)."""
    from types import SimpleNamespace

    from fsdp_lib.data.chat import add_end_of_turn_stop, end_of_turn_id

    ends = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>", "gemma": "<end_of_turn>", "mistral": None}
    for template, token in ends.items():
        tokenizer = _tokenizer(chat_models[template])
        expected = tokenizer.convert_tokens_to_ids(token) if token else None
        assert end_of_turn_id(tokenizer) == expected, template
    tokenizer = _tokenizer(chat_models["qwen2.5"])
    stop = end_of_turn_id(tokenizer)
    config = SimpleNamespace(bos_token_id=1, eos_token_id=2)
    add_end_of_turn_stop(tmp_path, tokenizer, config)  # no generation_config.json: one from the model's config
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": [2, stop],
    }
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop], "temperature": 0.6}))
    add_end_of_turn_stop(tmp_path, tokenizer, config)  # already a stop: left as it was
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "eos_token_id": [2, stop],
        "temperature": 0.6,
    }
    tokenizer.chat_template = None
    assert end_of_turn_id(tokenizer) is None


def test_loss_on_all_trains_every_token(chat_models):
    tokenizer = _tokenizer(chat_models["qwen2.5"])
    [(ids, mask)] = ChatEncoder(tokenizer, "all").encode(arithmetic_conversations(1), {})
    assert mask.all() and len(ids) == len(mask)


def test_masks_equal_transformers_generation_markers(chat_models):
    """Where a template marks assistant text with {% generation %}, transformers' own mask is the reference."""
    tokenizer = _tokenizer(chat_models["qwen2.5"])
    conversations = arithmetic_conversations(8)
    # characters the tiny tokenizer splits into several byte tokens that share one character offset
    conversations.append([{"role": "user", "content": "Données?"}, {"role": "assistant", "content": "数据 ß é."}])
    ours = ChatEncoder(tokenizer, "assistant").encode(conversations, {})
    assert len(ours) == len(conversations)
    tokenizer.chat_template = (CHAT_TEMPLATES / "qwen2.5_generation_markers.jinja").read_text()
    for conversation, (ids, mask) in zip(conversations, ours):
        reference = tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert reference["input_ids"] == list(ids)
        assert reference["assistant_masks"] == mask.tolist()


def test_conversations_a_template_refuses_are_skipped_and_counted(chat_models):
    tokenizer = _tokenizer(chat_models["gemma"])
    conversations = arithmetic_conversations(4, system=True)  # conversations 1 and 3 have a system turn
    skipped: dict[str, int] = {}
    encoded = ChatEncoder(tokenizer, "assistant").encode(conversations, skipped)
    assert len(encoded) == 2
    assert list(skipped.values()) == [2] and "System role not supported" in next(iter(skipped))


def test_conversations_with_no_reply_to_learn_are_counted_skips(chat_models):
    """With --loss-on assistant a conversation without an assistant turn trained as context carrying no loss (a
    dataset of them was blamed on the chat template), and one whose replies are all empty taught empty answers;
    both are counted skips now. A reply that only calls a tool is a reply; --loss-on all trains them all."""
    tokenizer = _tokenizer(chat_models["qwen2.5"])
    user = {"role": "user", "content": "What is 2 plus 2?"}
    call = {"name": "add", "arguments": {"a": 2, "b": 2}}
    conversations = [
        [user],
        [{"role": "system", "content": "Be brief."}],
        [user, {"role": "assistant", "content": " "}],
        [user, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}],
        [user, {"role": "assistant", "content": "4."}],
    ]
    skipped: dict[str, int] = {}
    first: dict[str, int] = {}
    assert len(ChatEncoder(tokenizer, "assistant").encode(conversations, skipped, first)) == 2
    assert first == {
        "no assistant turn: nothing to train with --loss-on assistant": 0,
        "every assistant turn is empty: it would teach empty answers": 2,
    }
    assert skipped["no assistant turn: nothing to train with --loss-on assistant"] == 2
    assert len(ChatEncoder(tokenizer, "all").encode(conversations, {})) == 5


def test_a_template_that_rewrites_earlier_turns_is_a_counted_skip(chat_models):
    tokenizer = _tokenizer(chat_models["qwen2.5"])
    # renders the last user turn differently once an assistant answer follows it: prefixes do not match
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} [end]{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    skipped: dict[str, int] = {}
    assert ChatEncoder(tokenizer, "assistant").encode(arithmetic_conversations(3), skipped) == []
    assert sum(skipped.values()) == 3 and "differently" in next(iter(skipped))


def test_qwen3_style_multi_turn_trains_every_assistant_turn_as_a_final_turn(chat_models):
    """Qwen3 renders earlier assistant turns without the <think></think> block the final turn gets: each assistant
    turn becomes its own sample, turns[:i+1], trained on that turn exactly as the template renders a final one."""
    tokenizer = _tokenizer(chat_models["qwen3"])
    conversations = arithmetic_conversations(6)  # odd ones: a system turn and two exchanges
    encoder = ChatEncoder(tokenizer, "assistant")
    skipped: dict[str, int] = {}
    encoded = encoder.encode(conversations, skipped)
    samples = [c[: i + 1] for c in conversations for i, t in enumerate(c) if t["role"] == "assistant"]
    assert not skipped and len(encoded) == len(samples) == 9 and encoder.expanded == 3
    for sample, (ids, mask) in zip(samples, encoded):
        ids = np.asarray(ids)
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(sample, tokenize=False)
        assert tokenizer.decode(ids[mask == 1]) == "<think>\n\n</think>\n\n" + sample[-1]["content"] + "<|im_end|>\n"


def test_reasoning_given_apart_trains_where_the_template_renders_it_and_is_refused_where_not(chat_models, tmp_path):
    """An assistant turn's reasoning given beside its content (reasoning_content as data_hf.py stores it, or
    gpt-oss's thinking in a dataset made elsewhere, which transformers gives the template as reasoning_content too)
    is trained inside the turn where the template renders it (Qwen3's <think> block; each turn a final one, its own
    sample); a template that renders none of the dataset's keys would drop every trace, and is refused naming the
    fix, before any data is read (a resumed run is warned)."""
    from datasets import Dataset

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.data.chat import chat_encoder, reasoning_keys
    from fsdp_lib.errors import TrainError

    q1, q2 = {"role": "user", "content": "2+2?"}, {"role": "user", "content": "3+3?"}
    first = {"role": "assistant", "content": "4.", "reasoning_content": "Two and two.", "name": None}
    second = {"role": "assistant", "content": "6.", "thinking": "Three and three."}  # made elsewhere
    tokenizer = _tokenizer(chat_models["qwen3"])
    encoder = ChatEncoder(tokenizer, "assistant")
    skipped: dict[str, int] = {}
    encoded = encoder.encode([[q1, first, q2, second]], skipped)
    trained = [tokenizer.decode(np.asarray(ids)[mask == 1]) for ids, mask in encoded]
    assert not skipped and encoder.expanded == 1, skipped  # the earlier turn's reasoning is stripped in the whole
    assert trained == [
        "<think>\nTwo and two.\n</think>\n\n4.<|im_end|>\n",
        "<think>\nThree and three.\n</think>\n\n6.<|im_end|>\n",
    ]
    with_reasoning = Dataset.from_list([{"messages": [q1, {**first, "name": None}]}])
    blank = Dataset.from_list([{"messages": [q1, {**first, "reasoning_content": "  "}]}])
    plain = Dataset.from_list([{"messages": [q1, {"role": "assistant", "content": "4."}]}])
    assert reasoning_keys(with_reasoning) == {"reasoning_content"} and not reasoning_keys(blank)
    assert not reasoning_keys(plain)
    cfg = TrainConfig(model_name=str(chat_models["llama3"]), dataset_name=["d"])
    assert chat_encoder(cfg, tokenizer, ["messages"], dataset="d", reasoning={"reasoning_content"}) is not None
    with pytest.raises(TrainError, match="reasoning given apart from their content .* does not render") as err:
        chat_encoder(cfg, _tokenizer(chat_models["llama3"]), ["messages"], dataset="d", reasoning={"reasoning_content"})
    assert "--dataset-name d" in str(err.value) and "--chat-template FILE" in str(err.value)
    (tmp_path / "out" / "x" / "checkpoint" / "step_00000002").mkdir(parents=True)  # a run that began so: warned
    resumed = TrainConfig(model_name="m", dataset_name=["d"], experiment_name="x", save_dir=str(tmp_path / "out"))
    assert chat_encoder(
        resumed, _tokenizer(chat_models["llama3"]), ["messages"], dataset="d", reasoning={"reasoning_content"}
    )


@pytest.mark.parametrize("template", ["llama3", "qwen2.5", "qwen3"])
def test_a_conversation_that_starts_with_the_assistant_trains_its_answer_only(template, chat_models):
    """Not the BOS, the system prompt the template adds, or the assistant header: only what the model answers."""
    tokenizer = _tokenizer(chat_models[template])
    conversation = [{"role": "assistant", "content": "Ask me a sum."}] + arithmetic_conversations(1, system=False)[0]
    encoded = ChatEncoder(tokenizer, "assistant").encode([conversation], {})
    assert len(encoded) == (2 if template == "qwen3" else 1)  # qwen3: one sample per assistant turn
    ids, mask = np.asarray(encoded[0][0]), encoded[0][1]
    first_run_end = int(np.argmax(np.diff(np.append(mask, 0).astype(int)) == -1)) + 1
    first = tokenizer.decode(ids[:first_run_end][mask[:first_run_end] == 1])
    expected = {"llama3": ASSISTANT_SPANS["llama3"], "qwen2.5": ASSISTANT_SPANS["qwen2.5"]}
    expected["qwen3"] = lambda c: "<think>\n\n</think>\n\n" + c + "<|im_end|>\n"  # its own sample
    assert first == expected[template]("Ask me a sum.")
    assert mask[0] == 0


def _metaspace_tokenizer(folder: Path, template: str):
    """A SentencePiece-style tokenizer (Metaspace: a space joins the word after it, "▁Five")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ["Five.", "Seven.", "Nine.", "User:", "Assistant:", "What", "is", "two", "plus", "three?"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        [" ".join(words)] * 50, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(folder)
    return _tokenizer(folder)


def test_tokens_that_straddle_a_span_boundary_are_trained_by_where_they_end(tmp_path):
    """The generation prompt ends in a space that the tokenizer merges into the answer ("Assistant: " + "Five." ->
    "▁Five."): that token carries the answer and is trained. The span's own last space merges into the next turn
    ("▁User:"): that token carries the next turn's text and is not."""
    template = (
        "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    )
    tokenizer = _metaspace_tokenizer(tmp_path / "metaspace", template)
    conversation = [
        {"role": "user", "content": "What is two plus three?"},
        {"role": "assistant", "content": "Five."},
        {"role": "user", "content": "What is two plus three?"},
        {"role": "assistant", "content": "Nine."},
    ]
    [(ids, mask)] = ChatEncoder(tokenizer, "assistant").encode([conversation], {})
    pieces = tokenizer.convert_ids_to_tokens(ids)
    trained = [p for p, m in zip(pieces, mask) if m]
    assert "▁Five." in pieces and "▁User:" in pieces  # the merges the test is about happen
    # the last turn's closing space is a token of its own at the end of the text, inside the span: trained
    assert trained == ["▁Five.", "▁Nine.", "▁"]


def test_skipped_conversations_warn_above_one_percent_and_stop_above_the_limit(capsys):
    from fsdp_lib.data.cache import report_skipped
    from fsdp_lib.errors import TrainError

    def skips(n: int) -> dict:
        return {"conversations": 1000, "expanded": 0, "skipped": {"refused": n}, "first_row": {"refused": 17}}

    report_skipped(skips(10), "the train split of chat_b", 0.05)  # 1%: reported, not loud
    out = capsys.readouterr().out
    assert (
        "skipped 10 conversation(s) of the train split of chat_b: refused (first: row 17)" in out
        and "WARNING" not in out
    )
    report_skipped(skips(30), "the train split of chat_b", 0.05)
    assert (
        "WARNING: 30 of 1000 conversations (3.0%) of the train split of chat_b are skipped" in capsys.readouterr().out
    )
    with pytest.raises(TrainError, match="--max-skipped-fraction 0.05") as refused:
        report_skipped(skips(60), "train", 0.05)
    assert "the most common reason (60): refused" in str(refused.value)
    assert "raise --max-skipped-fraction to train on the rest" in str(refused.value)
    report_skipped(skips(60), "train", 0.1)
    with pytest.raises(TrainError) as refused:  # every one skipped: raising the limit trains on nothing
        report_skipped(skips(1000), "train", 0.5)
    assert "1000 of 1000 conversations (100.0%)" in str(refused.value) and "none is left to train on" in str(
        refused.value
    )
    assert "raise --max-skipped-fraction" not in str(refused.value)


def test_a_run_that_would_skip_too_many_conversations_stops_naming_the_flag(tmp_path, chat_dataset, chat_models):
    """Gemma's template refuses system turns: half of these conversations have one."""
    args = trainer_args("gemma", chat_dataset, chat_models["gemma"], tmp_path) + ["--max-steps", "1"]
    result = run_trainer(args, nproc=1)
    out = output_of(result)
    assert result.returncode == 1 and "--max-skipped-fraction" in out and "first: row 1" in out
    result = run_trainer(args + ["--max-skipped-fraction", "0.6"], nproc=1)
    assert result.returncode == 0 and "WARNING:" in output_of(result)


# --- packing with document masking ---------------------------------------------------------------


def test_document_masking_restarts_positions_and_skips_cross_document_targets():
    tokens = np.arange(100, 121)  # documents [0,7), [7,9), [9,21)
    blocks = PackedBlocks(tokens, 5, doc_ends=np.array([7, 9, 21]))
    batch = blocks.gather([0, 1, 2, 3])
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 0], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    # targets 107 and 109 begin documents: nothing before them in the block predicts them
    assert batch.labels.tolist() == [
        [101, 102, 103, 104, 105],
        [106, -100, 108, -100, 110],
        [111, 112, 113, 114, 115],
        [116, 117, 118, 119, 120],
    ]
    assert blocks.trained_tokens([0, 1, 2, 3]) == 18
    unmasked = PackedBlocks(tokens, 5).gather([1])
    assert unmasked.position_ids is None and unmasked.labels.tolist() == [[106, 107, 108, 109, 110]]


def test_trained_mask_and_document_masking_combine():
    tokens = np.arange(11)
    trained = np.array([0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=np.uint8)
    blocks = PackedBlocks(tokens, 5, trained=trained, doc_ends=np.array([5, 11]))
    batch = blocks.gather([0, 1])
    assert batch.labels.tolist() == [[-100, 2, 3, -100, -100], [-100, -100, 7, 8, -100]][:1] + [[-100, 7, 8, -100, 10]]
    assert blocks.trained_tokens([0, 1]) == int((batch.labels != -100).sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_changing_one_document_leaves_the_next_documents_logits_unchanged(tmp_path, attn):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama", 64, 0)
    config.use_cache = False  # as in training: with a KV cache, transformers ignores packed position ids
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    rng = np.random.default_rng(0)
    first, second = rng.integers(1, 64, 12), rng.integers(1, 64, 20)
    blocks = PackedBlocks(np.concatenate([first, second, [0]]), 32, doc_ends=np.array([12, 32, 33]))
    changed_first = rng.integers(1, 64, 12)
    other = PackedBlocks(np.concatenate([changed_first, second, [0]]), 32, doc_ends=np.array([12, 32, 33]))
    with torch.no_grad():
        a, b = (
            model(input_ids=x.input_ids, position_ids=x.position_ids).logits
            for x in (blocks.gather([0]), other.gather([0]))
        )
        alone = model(input_ids=torch.from_numpy(second)[None]).logits
        leak_a, leak_b = (model(input_ids=x.gather([0]).input_ids).logits for x in (blocks, other))
    assert torch.equal(blocks.gather([0]).position_ids[0, 12:], torch.arange(20))
    torch.testing.assert_close(a[0, 12:], b[0, 12:], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[0, 12:], alone[0], rtol=0, atol=1e-5)  # as if the document were alone
    assert not torch.allclose(leak_a[0, 12:], leak_b[0, 12:], atol=1e-3)  # without masking, it would leak


# --- training runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory) -> Path:
    return make_chat_dataset(tmp_path_factory.mktemp("chat_data") / "conversations")


def test_masked_loss_is_the_same_at_any_split_of_the_global_batch(tmp_path, chat_dataset, chat_models):
    """1 process x accum 2 == 2 processes x accum 1: the mean is over the global batch's trained tokens."""
    losses = {}
    for nproc, accum in ((1, 2), (2, 1)):
        exp = f"split_{nproc}x{accum}"
        args = trainer_args(exp, chat_dataset, chat_models["qwen2.5"], tmp_path)
        args += ["-b", "2", "--grad-accum-steps", str(accum), "--max-steps", "4"]
        result = run_trainer(args, nproc=nproc)
        assert result.returncode == 0, output_of(result)
        losses[nproc] = losses_by_step(tmp_path / exp)
    assert losses[1].keys() == losses[2].keys() == {1, 2, 3, 4}
    for step in losses[1]:
        assert losses[1][step] == pytest.approx(losses[2][step], rel=1e-5)


def test_a_step_whose_batch_trains_no_token_logs_no_loss_rather_than_zero(tmp_path, chat_models):
    """A long prompt cut into blocks: the first block holds prompt tokens only. Its step logged loss=0 (metrics.jsonl,
    loss.png), a drop of the curve to zero; it logs null ("n/a") and the plot leaves it out."""
    import datasets

    long_prompt = " ".join(f"word{i}" for i in range(120))
    rows = [[{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "Short answer."}]] * 4
    datasets.Dataset.from_dict({"messages": rows}).save_to_disk(str(tmp_path / "long_chat"))
    args = trainer_args("long", tmp_path / "long_chat", chat_models["qwen2.5"], tmp_path)
    args += ["-b", "1", "--max-steps", "2", "--log-freq", "1", "--seq-length", "32", "--packing", "stream"]
    result = run_trainer(args, nproc=1)
    assert result.returncode == 0, output_of(result)
    first = read_metrics(tmp_path / "long")[0]
    assert first["step"] == 1 and first["trained_tokens"] == 0, first
    assert first["loss"] is None and first["loss_avg"] is None and first["grad_norm"] is None, first
    assert "loss=n/a loss_avg=n/a" in output_of(result)
    assert "step 1: no target of its global batch carries loss, so no update" in output_of(result)
    # and the weights do not move at such a step: AdamW's weight decay (and momentum) moved them before
    from safetensors.torch import load_file

    from tests.fsdp_helpers import make_chat_model

    start = make_chat_model(tmp_path / "weighted", "qwen2.5", with_weights=True)
    args = trainer_args("empty", tmp_path / "long_chat", start, tmp_path)
    args += ["-b", "1", "--max-steps", "1", "--seq-length", "32", "--packing", "stream", "--weight-decay", "0.5"]
    result = run_trainer(args, nproc=1)
    assert result.returncode == 0, output_of(result)
    (exported,) = (tmp_path / "empty" / "final").glob("model-*.safetensors")
    before, after = load_file(start / "model.safetensors"), load_file(exported)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_chat_data_without_a_template_names_the_flag(tmp_path, chat_dataset):
    model = make_chat_model(tmp_path / "no_template", template=None)
    result = run_trainer(trainer_args("nt", chat_dataset, model, tmp_path) + ["--max-steps", "1"], nproc=1)
    assert result.returncode != 0 and "--chat-template" in output_of(result)
    users_only = tmp_path / "users_only.jinja"  # renders no assistant turn: nothing would carry loss
    users_only.write_text("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endif %}{% endfor %}")
    silent = trainer_args("nt", chat_dataset, model, tmp_path) + [
        "--max-steps",
        "1",
        "--chat-template",
        str(users_only),
    ]
    result = run_trainer(silent, nproc=1)
    said = output_of(result)
    assert result.returncode == 1, said  # (torchrun adds its own report of the failed worker)
    assert (
        f"ERROR: --dataset-name {chat_dataset}: no token carries loss: the chat template (--chat-template {users_only}) renders no assistant"
        in said
    )
    fixed = trainer_args("nt", chat_dataset, model, tmp_path)
    template = shutil.copy(CHAT_TEMPLATES / "llama3.jinja", tmp_path / "llama3.jinja")
    fixed += ["--max-steps", "2", "--chat-template", str(template)]
    result = run_trainer(fixed, nproc=1)
    assert result.returncode == 0, output_of(result)
    final = tmp_path / "nt" / "final"
    exported = {f.name: f.read_bytes() for f in final.iterdir()}
    assert "start_header_id" in str(exported.get("chat_template.jinja")) + str(exported["tokenizer_config.json"])
    # generate() stops at the template's end of turn: <|eot_id|> joins the EOS (the base talked on past its reply)
    from transformers import AutoTokenizer

    eot = AutoTokenizer.from_pretrained(final).convert_tokens_to_ids("<|eot_id|>")
    assert eot in json.loads(exported["generation_config.json"])["eos_token_id"]
    # the checkpoint keeps the template: `-e nt --export-only` writes the same export with the file gone
    Path(template).unlink()
    shutil.rmtree(final)
    result = run_trainer(["-e", "nt", "--save-dir", str(tmp_path), "--export-only"], nproc=1)
    assert result.returncode == 0, output_of(result)
    assert {f.name: f.read_bytes() for f in final.iterdir()} == exported


# --- resume of SFT runs --------------------------------------------------------------------------

SFT_STEPS = 10


def sft_flags(dataset: Path, model: Path, save: Path, nproc: int = 2) -> list[str]:
    """Global batch 4 at 1 or 2 processes; constant LR so runs of different lengths share the schedule."""
    args = trainer_args("run", dataset, model, save) + ["-b", "2", "--grad-accum-steps", str(2 // nproc)]
    args += ["--max-steps", str(SFT_STEPS), "--ckpt-freq", "4", "--lr-schedule", "constant"]
    args[args.index("--warmup-steps") + 1] = "0"
    return args


@pytest.fixture(scope="module")
def sft_reference_run(chat_dataset, chat_models, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted SFT run the resumed ones must reproduce: (its experiment folder, what it printed)."""
    save = tmp_path_factory.mktemp("sft_reference")
    proc = run_trainer(sft_flags(chat_dataset, chat_models["llama3"], save))
    assert proc.returncode == 0, output_of(proc)
    return save / "run", output_of(proc)


@pytest.fixture(scope="module")
def sft_reference(sft_reference_run) -> dict[int, float]:
    return losses_by_step(sft_reference_run[0])


def test_sft_run_trains_on_assistant_tokens_and_reports_them(sft_reference_run):
    experiment, out = sft_reference_run
    assert "SFT on conversations" in out and "loss on assistant tokens" in out
    assert "--packing whole (auto): " in out and " conversations packed whole into " in out  # none straddles
    rows = read_metrics(experiment)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(0 < r["trained_tokens"] < 2 * 2 * 32 for r in rows)  # a window of one step: 128 targets
    assert all(r["trained_tokens_per_s"] < r["tokens_per_s"] for r in rows)
    val = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in val)
    assert (experiment / "final" / "tokenizer_config.json").is_file()


def test_sft_kill9_rerun_is_bit_identical_and_one_process_continues_it(
    chat_dataset, chat_models, sft_reference, tmp_path
):
    """kill -9 at step 6 (checkpoint 4); the same command resumes at 4 and trains steps 5-8 bit for bit as the
    uninterrupted run, until it is killed right after saving step 8 (a fault point); then one process (the same
    global batch: --grad-accum-steps 2) continues from step 8 to the end, within 1e-5 of the uninterrupted run."""
    args = sft_flags(chat_dataset, chat_models["llama3"], tmp_path)
    killed_at_step(args, tmp_path / "run", 6, delay_s="0.25", timeout=180)
    rerun = run_trainer(args, env={"FSDP_TRAIN_FAULT": "kill_after_rename@0:8"})
    assert rerun.returncode != 0 and "at step 4" in output_of(rerun), output_of(rerun)
    resumed = losses_by_step(tmp_path / "run")
    assert all(resumed[s] == sft_reference[s] for s in range(5, 9)), (resumed, sft_reference)
    one = run_trainer(sft_flags(chat_dataset, chat_models["llama3"], tmp_path, nproc=1), nproc=1)
    assert one.returncode == 0, output_of(one)
    assert "world size changed (2 -> 1)" in output_of(one) and "at step 8" in output_of(one)
    got = losses_by_step(tmp_path / "run")
    assert sorted(got) == list(range(1, SFT_STEPS + 1))
    for step in range(9, SFT_STEPS + 1):
        assert got[step] == pytest.approx(sft_reference[step], abs=1e-5)


def test_packing_stream_says_what_straddles_and_a_stream_run_is_not_resumed_whole(chat_dataset, chat_models, tmp_path):
    """--packing stream cuts one token stream into blocks: the log counts the conversations a block boundary cuts.
    A run begun so is not resumed with another packing (its blocks are others): the refusal names --packing and
    the value that resumes it (the checkpoints of runs from before whole packing became the default)."""
    args = [*sft_flags(chat_dataset, chat_models["llama3"], tmp_path), "--max-steps", "2"]
    stream = run_trainer([*args, "--packing", "stream"])
    said = output_of(stream)
    assert stream.returncode == 0, said
    assert "--packing stream: " in said and "start in one block and end in the next" in said
    refused = run_trainer([*args, "--max-steps", "3"])
    said = output_of(refused)
    assert refused.returncode != 0 and "--packing: checkpoint stream vs now whole" in said, said
    assert "--packing stream resumes this run as it began" in said
