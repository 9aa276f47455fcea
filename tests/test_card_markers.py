# ruff: noqa: F811  (task_paths and trained, imported from other test modules, are fixtures named as parameters)
"""A model card rewrite keeps the user's own text (care/export/card_file.py): `evaluate.py ckpt=final` rewrites
only the generated part of a tiny M3 run's README.md (front matter and the text between the markers), keeps
what the user wrote around it, and leaves alone a README whose generated part was edited or that is not the
project's card, saying so.  The reference is the README as the user left it (its bytes, and the text they
added), and huggingface_hub's own ModelCard.load for the card that is written."""
from __future__ import annotations

import pytest
from huggingface_hub import ModelCard
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: a fixture)
from test_model_card import trained  # noqa: F401  (trained: a fixture, a 2-step tiny M3 run)

from care.config import load_config
from care.encoders.registry import read_record
from care.export.card import write_model_card
from care.export.card_file import CardKept

pytestmark = pytest.mark.usefixtures("one_thread")

NOTES = "\n## Our notes\n\nTried on the ward's FAQ: fine.\n"


def test_a_rewrite_keeps_the_users_text_and_an_edited_card_is_left_alone(trained, task_paths, tmp_path, capsys):
    from evaluate import evaluate

    card = trained["final"] / "README.md"
    written = card.read_text(encoding="utf-8")
    assert written.startswith("---\n") and "<!-- care-medical card: end -->" in written
    card.write_text(written + NOTES, encoding="utf-8")

    cfg = overrides(task_paths, tmp_path, f"ckpt={trained['final']}", "baselines=[]", "efficiency.enabled=false",
                    cmedqa2=False)
    evaluate(load_config("evaluate", cfg))
    text = card.read_text(encoding="utf-8")
    assert text.endswith(NOTES) and text.startswith("---\n")  # the front matter stays at the top
    assert ModelCard.load(card).data.eval_results  # the generated part now holds the evaluation

    # an edit inside the generated part: the card is left as the user left it, and a warning says so
    edited = text.replace("## How to load", "## How to load (we use FlagEmbedding)")
    card.write_text(edited, encoding="utf-8")
    evaluate(load_config("evaluate", [*cfg, "overwrite=true"]))
    assert card.read_text(encoding="utf-8") == edited
    assert "its generated part (the front matter, or the text between the care-medical markers) was edited" \
        in capsys.readouterr().err

    # a README that is not a care-medical card (written by hand): never replaced
    card.write_text("# My model\n\nHand-written.\n", encoding="utf-8")
    with pytest.raises(CardKept, match="not a care-medical card"):
        write_model_card(trained["final"], read_record(trained["final"]))
    assert card.read_text(encoding="utf-8") == "# My model\n\nHand-written.\n"


@pytest.mark.parametrize("editor", ["last newline stripped", "CRLF", "CRLF, last newline stripped"])
def test_what_an_editor_does_to_the_whole_file_is_not_an_edit(trained, tmp_path, editor):
    """An editor that strips the file's last newline, or saves it with CRLF line ends (or both), leaves the
    generated part as the project wrote it: the card is rewritten, the user's text kept (the line ends they
    chose too), never "not a care-medical card"."""
    import shutil

    folder = tmp_path / "final"
    shutil.copytree(trained["final"], folder)
    card = folder / "README.md"
    card.unlink(missing_ok=True)  # whatever another test left there: the card is written fresh
    for user_text in ("", NOTES):  # the end marker closes the file, or the user's notes do
        text = write_model_card(folder, read_record(folder)).read_text(encoding="utf-8") + user_text
        if "stripped" in editor:
            text = text.rstrip("\n")
        if "CRLF" in editor:
            text = text.replace("\n", "\r\n")
        card.write_bytes(text.encode("utf-8"))
        write_model_card(folder, read_record(folder))
        again = card.read_bytes().decode("utf-8")
        assert ("\r\n" in again) == ("CRLF" in editor) and "\n" in again
        plain = again.replace("\r\n", "\n")
        assert plain.startswith("---\n") and plain.count("<!-- care-medical card: end -->") == 1
        if user_text:
            assert plain.endswith(NOTES.rstrip("\n") if "stripped" in editor else NOTES)
        else:
            assert plain.rstrip("\n").endswith("<!-- care-medical card: end -->")
        assert ModelCard.load(card).data.base_model == "tiny-m3"
