"""Issue 52, item 4: ``ds-longctx needle`` without --tokenizer on a model whose vocabulary is past 256 (its UTF-8 byte
tokenizer cannot decode every id the model predicts): the table, every prediction printable (was: ValueError: bytes must
be in range(0, 256) in ByteTokenizer.decode after scoring)."""
import json

from ds_longctx.eval.needle import ByteTokenizer


def test_byte_tokenizer_decodes_ids_past_a_byte():
    tok = ByteTokenizer(512)
    assert tok.decode(tok.encode("key 42")) == "key 42"
    assert tok.decode([107, 300, 101, 121, 511]) == "k<300>ey<511>"
    assert ByteTokenizer(64).decode([3, 63]) == "3 63"


def test_needle_command_on_a_vocab_512_model_without_a_tokenizer(tmp_path, capsys):
    from ds_longctx.cli import main
    from tiny_models import tiny_config

    cfg = tiny_config(vocab=512, max_position_embeddings=1024)
    cfg.save_pretrained(tmp_path / "m")
    argv = ["needle", "--model-config", str(tmp_path / "m" / "config.json"), "--lengths", "128", "--depths", "0,1",
            "--json", str(tmp_path / "n.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "depth \\ length" in out and "128" in out, out
    report = json.loads((tmp_path / "n.json").read_text())
    assert len(report["results"]) == 2
    assert all(isinstance(r["predicted"], str) for r in report["results"])
