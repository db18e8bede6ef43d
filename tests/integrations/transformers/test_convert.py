"""Translator.from_pretrained on Opus-MT- and NLLB-like checkpoints built here: the imported
model's logits are the Hugging Face model's, and its greedy and beam-4 translations are
transformers' generate() outputs with the same beam, length penalty and limits."""

import copy

import pytest
import torch
import transformers

import fastnmt
from fastnmt.integrations.transformers import UnsupportedModelError
from fastnmt.translate import main as translate_main
from tests.helpers import assert_error_within
from tests.integrations.transformers.models import marian_directory, nllb_directory, tiny_model

LINES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs play in the snow.",
    "A child",
    "",
    "People are walking down a busy city street at night while a woman sings.",
]
NLLB = dict(src_lang="eng_Latn", tgt_lang="deu_Latn")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    return {"marian": marian_directory(folder), "nllb": nllb_directory(folder)}


def hf_model_and_tokenizer(directory, languages):
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        directory, **({"src_lang": languages["src_lang"]} if languages else {})
    )
    return model, tokenizer


@pytest.mark.parametrize("kind", ["marian", "nllb"])
def test_logits_equal_the_hf_models(checkpoints, kind):
    """On the device the translator picked (a GPU where there is one), by the FlashAttention rule
    against the Hugging Face model run in float64 there, with transformers in fp32 as the bar."""
    languages = NLLB if kind == "nllb" else {}
    translator = fastnmt.Translator.from_pretrained(
        checkpoints[kind], precision="fp32", **languages
    )
    model = translator.model
    device = model.embedding.weight.device
    hf, tokenizer = hf_model_and_tokenizer(checkpoints[kind], languages)
    hf.to(device)
    batch = tokenizer(LINES[:3], return_tensors="pt", padding=True).to(device)
    decoder_in = torch.randint(3, 90, (3, 6), device=device)
    decoder_in[:, 0] = hf.config.decoder_start_token_id
    with torch.no_grad():
        plain = hf(**batch, decoder_input_ids=decoder_in).logits
        oracle = copy.deepcopy(hf).double()(**batch, decoder_input_ids=decoder_in).logits
    lengths = batch["attention_mask"].sum(1)
    states = model.decode(decoder_in, model.encode(batch["input_ids"], lengths), lengths)
    assert_error_within(model.logits(states), plain, oracle, factor=2, atol=1e-5)
    last = model.output_layer()(states[:, -1])
    assert_error_within(last, plain[:, -1], oracle[:, -1], factor=2, atol=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("kind", ["marian", "nllb"])
def test_translations_equal_hf_generate(checkpoints, kind, beam):
    languages = NLLB if kind == "nllb" else {}
    translator = fastnmt.Translator.from_pretrained(
        checkpoints[kind], precision="fp32", **languages
    )
    hf, tokenizer = hf_model_and_tokenizer(checkpoints[kind], languages)
    texts = [line for line in LINES if line]
    forced = {"forced_bos_token_id": translator.target_prefix[0]} if languages else {}
    generated = hf.generate(
        **tokenizer(texts, return_tensors="pt", padding=True),
        num_beams=beam,
        max_new_tokens=16,
        length_penalty=1.0,
        early_stopping=True,
        do_sample=False,
        **forced,
    )
    expected = tokenizer.batch_decode(generated, skip_special_tokens=True)
    found = translator.translate_full(LINES, beam=beam, lenpen=1.0, max_len_a=0, max_len_b=16)
    assert [t.text for t in found if t.source] == expected
    assert found[3].text == ""
    expected_ids = [
        [i for i in row.tolist()[1:] if i != tokenizer.pad_token_id] for row in generated
    ]
    found_ids = [
        translator.target_prefix + c.tokens + [translator.vocab.eos_id] * c.ended
        for c in (t.candidates[0] for t in found if t.source)
    ]
    assert found_ids == expected_ids
    assert len(set(expected)) > 1  # the sentences differ: a real comparison


@pytest.mark.parametrize("kind", ["marian", "nllb"])
def test_scores_are_the_hf_models_log_probabilities(checkpoints, kind):
    """Translator.score encodes the targets as transformers' ``text_target`` does (Opus-MT: with
    its target.spm) and gives minus the Hugging Face model's summed cross entropy of each pair;
    NLLB's target language code is the decoder's forced prefix, conditioned on and not scored,
    as in the search."""
    languages = NLLB if kind == "nllb" else {}
    translator = fastnmt.Translator.from_pretrained(
        checkpoints[kind], precision="fp32", **languages
    )
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(checkpoints[kind]).eval().double()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[kind], **languages)
    sources = LINES[:3]
    targets = ["Ein Mann steht auf einer Leiter.", "Zwei Hunde spielen im Schnee.", "Ein Kind"]
    batch = tokenizer(sources, text_target=targets, return_tensors="pt", padding=True)
    labels = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    with torch.no_grad():
        logits = hf(batch["input_ids"], batch["attention_mask"], labels=labels).logits
    scored = labels.clone()
    scored[:, : len(translator.target_prefix)] = -100  # the forced language code
    expected = -torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), scored, ignore_index=-100, reduction="none"
    ).sum(1)
    scores = translator.score(sources, targets)
    assert [s.tokens for s in scores] == (scored != -100).sum(1).tolist()
    found = torch.tensor([s.log_prob for s in scores], dtype=torch.float64)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["marian", "nllb"])
def test_a_target_prefix_is_encoded_by_the_target_side(checkpoints, kind):
    """prefix= on a Hugging Face model: the translation starts with the prefix's target-side ids
    (after NLLB's language code), blank prefixes force nothing."""
    languages = NLLB if kind == "nllb" else {}
    translator = fastnmt.Translator.from_pretrained(
        checkpoints[kind], precision="fp32", **languages
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[kind], **languages)
    forced = tokenizer(text_target="Ein Hund", add_special_tokens=False)["input_ids"]
    found = translator.translate_full(LINES[:2], prefix=["Ein Hund", " "], max_len_b=12)
    assert found[0].candidates[0].tokens[: len(forced)] == forced
    assert found[1].text == translator.translate(LINES[1:2], max_len_b=12)[0]


def test_translate_cli_serves_a_hf_directory(checkpoints, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES[:3]) + "\n", encoding="utf-8")
    arguments = ["--checkpoint", str(checkpoints["nllb"]), "--input", str(source), "--beam", "2"]
    assert translate_main([*arguments, "--src-code", "eng_Latn", "--tgt-code", "deu_Latn"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert translate_main(arguments) == 2  # NLLB without a target language
    assert "tgt_lang must be a language code" in capsys.readouterr().err


def test_bad_models_and_languages_are_one_line_errors(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="tgt_lang must be a language code"):
        fastnmt.Translator.from_pretrained(checkpoints["nllb"], src_lang="eng_Latn")
    with pytest.raises(ValueError, match="src_lang/tgt_lang are for NLLB"):
        fastnmt.Translator.from_pretrained(checkpoints["marian"], tgt_lang="deu_Latn")
    tiny_model("bart").save_pretrained(tmp_path / "bart")
    with pytest.raises(UnsupportedModelError, match="supports model types"):
        fastnmt.Translator.from_pretrained(tmp_path / "bart")
