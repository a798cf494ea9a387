"""Training on your own data: chat records, loss masks, whole-sample packing.

The chat set and its tokenizer are made here (tests/support/chat_data.py): byte-level BPE from the `tokenizers`
library with a DeepSeek-shaped chat template, saved like a published tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dskit import catalog
from dskit.data import IGNORE_INDEX
from dskit.data.chat import encode_chat
from dskit.data.prepare import prepare
from dskit.data.sampler import Sampler, pad_width
from dskit.data.shards import TokenData
from dskit.data.tokenizers import tokenizer
from tests.conftest import dskit
from tests.support.chat_data import conversations, make_tokenizer, write_jsonl
from tests.support.cli import cli


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory, tok_dir) -> Path:
    d = tmp_path_factory.mktemp("chat")
    write_jsonl(d / "chat.jsonl", conversations(120))
    cli(
        "data",
        "prepare",
        str(d / "chat.jsonl"),
        "-o",
        str(d / "shards"),
        "--tokenizer",
        str(tok_dir),
        check=True,
    )
    return d / "shards"


def test_loss_mask_covers_exactly_the_assistant_turns(tok_dir):
    tok = tokenizer(str(tok_dir))
    msgs = conversations(1)[0]["messages"] + [
        {"role": "user", "content": "red dog"},
        {"role": "assistant", "content": "dog red"},
    ]
    ids, mask = encode_chat(msgs, tok)
    # The whole text is the template's rendering, and the targets are each reply plus its end token.
    assert tok.decode(ids) == tok._tok.apply_chat_template(msgs, tokenize=False)
    replies = [m["content"] for m in msgs if m["role"] == "assistant"]
    targets = tok.decode(ids[mask == 1])
    assert targets == "".join(f" {r}<|end|>" for r in replies)
    # No user or system text is a target.
    for m in msgs:
        if m["role"] != "assistant":
            assert m["content"] not in targets


def test_packed_rows_keep_samples_whole_with_labels_only_on_targets(chat_shards):
    data = TokenData.open(str(chat_shards))
    assert data.kind == "chat"
    sampler = Sampler(data, 96, seed=3)
    docs = Counter(
        tuple(np.asarray(s.tokens[a:b]))
        for s in data.shards
        for a, b in zip([0, *s.ends[:-1]], s.ends, strict=True)
    )
    seen: Counter = Counter()
    for g in range(sampler.windows):
        b = sampler.get(g, 1)
        pos, inp, lab = b.position_ids[0], b.input_ids[0], b.labels[0]
        starts = [i for i in range(len(pos)) if pos[i] == 0] + [len(pos)]
        for a, e in zip(starts, starts[1:], strict=False):
            if (lab[a:e] == IGNORE_INDEX).all():
                continue  # padding at the row's end
            # each sample is one whole document: its inputs, then its last label (the EOS)
            seen[(*inp[a:e], lab[e - 1])] += 1
    assert sampler.truncated == 0
    assert seen == docs  # one epoch of packs holds every sample once, whole


def _samples_tokens(b) -> list[int]:
    """Per row, the positions before its trailing padding (a last run of positions 0, 1, ... with no
    label), read from the batch alone."""
    out = []
    for pos, lab in zip(b.position_ids, b.labels, strict=True):
        last = max(i for i in range(len(pos)) if pos[i] == 0)
        out.append(last if last and (lab[last:] == IGNORE_INDEX).all() else len(pos))
    return out


def test_pad_rows_are_as_wide_as_a_bucket_of_the_longest_and_count_only_real_tokens(chat_shards):
    """`packing: pad` cuts each micro-batch to the narrowest of a few widths (seq_len halved) that holds
    its longest sample, so padding is not computed; every Batch counts the positions that hold a
    sample's token (what throughput and MFU count)."""
    data, L = TokenData.open(str(chat_shards)), 512
    pad, pack = Sampler(data, L, seed=3, packing="pad"), Sampler(data, L, seed=3)
    widths = set()
    for g in range(0, 40, 4):
        b = pad.get(g, 4)
        real = _samples_tokens(b)
        assert b.real_tokens == sum(real) and b.input_ids.shape[1] == pad_width(max(real), L)
        assert (
            max(real) <= b.input_ids.shape[1] and b.labels.shape == b.position_ids.shape == b.input_ids.shape
        )
        widths.add(b.input_ids.shape[1])
    assert len(widths) > 1 and max(widths) < L  # these short samples never needed the whole row
    assert {pad_width(n, L) for n in range(1, L + 1)} == {8, 16, 32, 64, 128, 256, 512}
    assert pad_width(100, 4096) == 128 and pad_width(4000, 4096) == 4096 and pad_width(5, 100) == 8
    assert {pad_width(n, 100) for n in range(1, 101)} == {8, 16, 32, 56, 100}
    packed = pack.get(0, 4)
    assert packed.input_ids.shape == (4, L) and packed.real_tokens == sum(_samples_tokens(packed)) < 4 * L


def test_a_mixture_of_pad_rows_widens_each_to_the_widest(chat_shards):
    """Sources cut their `pad` rows to their own buckets; a mixed micro-batch takes the widest, and
    the added columns are padding (no label, not counted as real tokens)."""
    from dskit.data.sampler import Mixture

    data, L = TokenData.open(str(chat_shards)), 512
    parts = [Sampler(data, L, seed=s, packing="pad") for s in (3, 4)]
    mix = Mixture(parts, [1.0, 1.0], seed=5)
    widths = set()
    for g in range(0, 64, 8):
        b = mix.get(g, 8)
        rows = [mix.samplers[i].get(k, 1) for i, k in (mix.source_of(x) for x in range(g, g + 8))]
        assert b.input_ids.shape == (8, max(r.input_ids.shape[1] for r in rows))
        assert b.labels.shape == b.position_ids.shape == b.input_ids.shape
        assert b.real_tokens == sum(r.real_tokens for r in rows) == sum(sum(_samples_tokens(r)) for r in rows)
        for j, r in enumerate(rows):
            w = r.input_ids.shape[1]
            assert (b.input_ids[j, :w] == r.input_ids[0]).all() and (b.labels[j, w:] == IGNORE_INDEX).all()
        widths.update(r.input_ids.shape[1] for r in rows)
    assert len(widths) > 1  # rows of different widths did meet


def test_sampling_is_a_pure_function_of_seed_and_sample_number(chat_shards):
    data = TokenData.open(str(chat_shards))
    a, b = Sampler(data, 96, seed=3), Sampler(data, 96, seed=3)
    # b jumps straight to sample 50 (a resume): it gets what a, reading from 0, gets there
    for g in range(0, 60):
        x = a.get(g, 1)
    y = b.get(59, 1)
    assert (x.input_ids == y.input_ids).all() and (x.labels == y.labels).all()
    assert (x.position_ids == y.position_ids).all()


def test_a_packed_row_gives_each_sample_the_logits_it_gets_alone(chat_shards):
    """Attention never crosses samples: the packed row's logits for each sample equal that sample's
    logits run alone (tiny DeepSeek-V2, MLA + MoE, SDPA on CPU, fp32)."""
    from transformers import AutoModelForCausalLM

    from dskit.train.model import hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(catalog.model("tiny-v2").config, "sdpa")).eval()
    # as the trainer's model (dskit/train/model.py): with a KV cache transformers ignores packed position
    # ids and the samples would attend to each other
    model.config.use_cache = False
    sampler = Sampler(TokenData.open(str(chat_shards)), 128, seed=3)
    b = sampler.get(0, 2)
    with torch.no_grad():
        packed = model(
            input_ids=torch.from_numpy(b.input_ids), position_ids=torch.from_numpy(b.position_ids)
        ).logits
        unmasked = model(input_ids=torch.from_numpy(b.input_ids)).logits
        checked = 0
        for row in range(2):
            pos = b.position_ids[row]
            starts = [i for i in range(len(pos)) if pos[i] == 0] + [len(pos)]
            assert len(starts) > 2  # several samples in the row
            for a, e in zip(starts, starts[1:], strict=False):
                alone = model(input_ids=torch.from_numpy(b.input_ids[row : row + 1, a:e])).logits[0]
                torch.testing.assert_close(packed[row, a:e], alone, rtol=1e-4, atol=1e-4)
                if a:
                    # without the position ids a later sample would see the earlier ones: the test can fail
                    assert not torch.allclose(unmasked[row, a:e], alone, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked >= 4


def test_old_shards_are_refused_with_a_re_prepare_hint(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    np.arange(300, dtype=np.uint16).tofile(d / "tokens-00000.bin")
    (d / "index.json").write_text(
        json.dumps(
            {
                "format": 1,
                "dtype": "uint16",
                "files": [["tokens-00000.bin", 300]],
                "tokenizer": "byte",
                "vocab_size": 259,
                "eos_id": 258,
                "documents": 1,
            }
        )
    )
    with pytest.raises(Exception) as e:
        TokenData.open(str(d))
    assert str(e.value) == (
        f"data.path: {d} holds shard format 1, this dskit reads format 2 (document ends and loss masks); "
        "prepare it again with `dskit data prepare`"
    )


def test_chat_records_with_the_byte_tokenizer_are_one_line_and_exit_2(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", conversations(2))
    r = cli("data", "prepare", str(tmp_path / "chat.jsonl"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr == (
        "dskit: error: --tokenizer: chat records ('messages') need a local tokenizer dir with a chat template, "
        "not 'byte'\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_message_without_a_known_role_is_one_line_and_exit_2(tmp_path, tok_dir):
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}])
    r = cli(
        "data",
        "prepare",
        str(tmp_path / "chat.jsonl"),
        "-o",
        str(tmp_path / "out"),
        "--tokenizer",
        str(tok_dir),
    )
    assert r.returncode == 2
    assert r.stderr == (
        f"dskit: error: {tmp_path / 'chat.jsonl'}:1 messages[0]: needs a 'role' (one of system, user, assistant) "
        "and a string 'content'\n"
    )


# --------------------------------------------------------------------------- inputs


def _write_inputs(d: Path, records: list[dict]) -> dict[str, Path]:
    """The same records as JSONL, JSONL.gz, JSONL.zst, Parquet and a datasets save_to_disk dir."""
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    out = {"jsonl": d / "a.jsonl", "gz": d / "a.jsonl.gz", "zst": d / "a.jsonl.zst"}
    out["jsonl"].write_bytes(body)
    out["gz"].write_bytes(gzip.compress(body))
    out["zst"].write_bytes(zstandard.ZstdCompressor().compress(body))
    out["parquet"] = d / "a.parquet"
    pq.write_table(pa.Table.from_pylist(records), out["parquet"], row_group_size=7)
    out["hf"] = d / "hf"
    datasets.Dataset.from_list(records).save_to_disk(str(out["hf"]))
    return out


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_every_input_format_gives_byte_identical_shards(tmp_path, tok_dir, kind):
    if kind == "chat":
        records = conversations(30)
    else:  # a configurable text field; other fields are ignored
        records = [
            {
                "body": f"document {i}: " + " ".join(conversations(1, seed=i)[0]["messages"][1]["content"]),
                "id": i,
            }
            for i in range(30)
        ]
    files = _write_inputs(tmp_path, records)
    got = {}
    for name, path in files.items():
        out = tmp_path / f"out-{name}"
        prepare([str(path)], str(out), tokenizer=str(tok_dir), text_field="body")
        got[name] = {
            f.name: f.read_bytes() for f in sorted(out.iterdir()) if f.is_file() and f.name != ".dskit-output"
        }
    assert all(g == got["jsonl"] for g in got.values()), {k: sorted(v) for k, v in got.items()}
    assert json.loads(got["jsonl"]["index.json"])["kind"] == kind
    assert json.loads(got["jsonl"]["index.json"])["documents"] == 30


def test_a_hub_name_is_refused_with_how_to_download_it(tmp_path):
    r = cli("data", "prepare", "deepseek-ai/some-dataset", "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr == (
        "dskit: error: inputs: deepseek-ai/some-dataset is not a local path; dskit downloads nothing: fetch it first "
        "(e.g. `huggingface-cli download --repo-type dataset NAME --local-dir DIR`, or datasets' save_to_disk) and "
        "give the local files or dir\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_parquet_file_without_the_text_column_names_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"content": "x", "id": 1}]), tmp_path / "a.parquet")
    r = cli("data", "prepare", str(tmp_path / "a.parquet"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr == (
        f"dskit: error: {tmp_path / 'a.parquet'}: has columns content, id; none is 'text' (--text-field) or "
        "'messages' (chat)\n"
    )


def test_a_datasets_dict_asks_for_one_split(tmp_path):
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"text": "a"}]),
            "test": datasets.Dataset.from_list([{"text": "b"}]),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    r = cli("data", "prepare", str(tmp_path / "dd"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert (
        r.stderr
        == f"dskit: error: {tmp_path / 'dd'}: is a DatasetDict; give one split's dir (splits: test, train)\n"
    )


# --------------------------------------------------------------------------- mixtures


def test_a_mixture_draws_by_weight_as_a_pure_function_of_the_sample_number(tmp_path):
    from dskit.data.sampler import Mixture

    # two text sources whose tokens tell them apart: 'a' bytes and 'b' bytes
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(name * 5000)
        prepare([str(tmp_path / f"{name}.txt")], str(tmp_path / name))

    def mixture() -> Mixture:
        parts = [Sampler(TokenData.open(str(tmp_path / n)), 16, seed=5) for n in ("a", "b")]
        return Mixture(parts, [3.0, 1.0], seed=5)

    m = mixture()
    rows = m.get(0, 4 * Mixture.BLOCK).input_ids
    from_a = (rows == ord("a")).any(axis=1)
    assert ((rows == ord("a")).all(axis=1) | (rows == ord("b")).any(axis=1)).all()  # one source per row
    assert from_a.sum() == 3 * Mixture.BLOCK  # exactly 3:1 in every block
    # a resumed run asks for sample 2500 first and gets what the uninterrupted run got
    again = mixture().get(2500, 8)
    assert (again.input_ids == rows[2500:2508]).all()


def test_data_sources_with_data_path_is_one_line_and_exit_2(tmp_path):
    spec = tmp_path / "dskit.yaml"
    spec.write_text("data:\n  path: x\n  sources:\n    - {path: y, weight: 1}\n")
    r = cli("plan", str(spec), "--gpu", "cpu")
    assert r.returncode == 2
    assert r.stderr == (
        "dskit: error: data.sources: given with data.path; use one of them (a one-source mixture is data.path)\n"
    )


@pytest.mark.slow  # spawns tokenizer processes, each importing transformers
def test_shards_are_byte_identical_whatever_the_number_of_tokenizer_processes(tmp_path, tok_dir):
    write_jsonl(tmp_path / "chat.jsonl", conversations(700, seed=4))  # three batches of 256 records
    got = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(
            [str(tmp_path / "chat.jsonl")],
            str(out),
            tokenizer=str(tok_dir),
            eval_fraction=0.05,
            workers=workers,
        )
        got.append({str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()})
    assert got[0] == got[1]
    assert "eval/index.json" in got[0]


@pytest.mark.slow  # spawns tokenizer processes, each importing transformers
def test_a_bad_record_in_a_tokenizer_process_is_the_same_one_line(tmp_path, tok_dir):
    # a tokenizer without a chat template: the error is raised where the template is applied, in a
    # tokenizer process, and reaches the user as the same one line (SpecError survives pickling)
    import shutil

    plain = tmp_path / "plain-tok"
    shutil.copytree(tok_dir, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    write_jsonl(tmp_path / "chat.jsonl", conversations(3))
    r = dskit(  # a real process: the error crosses from a spawned tokenizer process
        "data", "prepare", str(tmp_path / "chat.jsonl"), "-o", str(tmp_path / "out"),
        "--tokenizer", str(plain), "--workers", "2",
    )  # fmt: skip
    assert r.returncode == 2
    assert (
        r.stderr
        == f"dskit: error: --tokenizer: {plain.resolve()} has no chat template (tokenizer_config.json 'chat_template')\n"
    )
    assert not (tmp_path / "out").exists()


def test_an_eval_set_smaller_than_one_micro_batch_per_rank_is_refused_before_training(tmp_path, tok_dir):
    from tests.conftest import render_tiny
    from tests.train.test_train import rank0_alone

    write_jsonl(tmp_path / "chat.jsonl", conversations(200))
    prepare(
        [str(tmp_path / "chat.jsonl")], str(tmp_path / "shards"), tokenizer=str(tok_dir), eval_fraction=0.01
    )
    rd = render_tiny(tmp_path, "tiny-v2", extra=[f"data.path={tmp_path / 'shards'}"])
    r = rank0_alone(rd / "run.yaml")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"dskit: error: data.path: {tmp_path / 'shards' / 'eval'} holds ")
    assert r.stderr.endswith(
        "eval samples of 128 tokens, fewer than one micro-batch on every rank (8); hold out more (data prepare --eval-fraction)\n"
    )


def _refused(r, out: Path, stderr_has: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and stderr_has in r.stderr, r.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.dskit-tmp-*"))


def test_an_unknown_input_type_is_refused_not_read_as_one_text(tmp_path):
    """A .json (or .csv) read as plain text would become one garbled training document."""
    write_jsonl(tmp_path / "chat.json", conversations(2))
    out = tmp_path / "out"
    r = cli("data", "prepare", str(tmp_path / "chat.json"), "-o", str(out))
    _refused(r, out, "chat.json: unknown input type; one of: .txt/.text/.md (one document per file), .jsonl")


def test_a_cut_off_zstd_file_is_refused_not_read_short(tmp_path):
    import zstandard

    lines = "".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(2000)).encode()
    whole = zstandard.ZstdCompressor().compress(lines)
    (tmp_path / "whole.jsonl.zst").write_bytes(whole)
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "two-frames.jsonl.zst").write_bytes(whole + zstandard.ZstdCompressor().compress(lines))
    prepare([str(tmp_path / "two-frames.jsonl.zst")], str(tmp_path / "two"))
    assert json.loads((tmp_path / "two" / "index.json").read_text())["documents"] == 4000  # every frame
    out = tmp_path / "out"
    r = cli("data", "prepare", str(tmp_path / "cut.jsonl.zst"), "-o", str(out))
    _refused(r, out, "the zstd stream ends inside a frame (truncated file?)")
    (tmp_path / "not.jsonl.zst").write_text("plain text\n")
    r = cli("data", "prepare", str(tmp_path / "not.jsonl.zst"), "-o", str(out))
    _refused(r, out, "not.jsonl.zst: cannot read it: not a zstd stream or damaged")


def test_a_pipe_is_refused_since_inputs_are_read_twice(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "dskit", "data", "prepare", "/dev/stdin", "-o", str(out)],
        input='{"text": "hello"}\n',
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    _refused(r, out, "/dev/stdin: is not a regular file (a pipe or a device?)")


@pytest.mark.slow  # spawns tokenizer processes, each importing transformers
def test_chat_template_errors_and_assistant_first_conversations_are_one_line(tmp_path, tok_dir):
    import shutil

    bad = tmp_path / "bad-tok"
    shutil.copytree(tok_dir, bad)
    (bad / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    if "chat_template" in cfg:
        cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
        (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    write_jsonl(tmp_path / "chat.jsonl", conversations(3))
    out = tmp_path / "out"
    for workers in ("1", "2"):
        r = cli(
            "data", "prepare", str(tmp_path / "chat.jsonl"), "-o", str(out),
            "--tokenizer", str(bad), "--workers", workers,
        )  # fmt: skip
        _refused(r, out, "--tokenizer: ")
        assert "its chat template failed: roles must alternate" in r.stderr
    write_jsonl(tmp_path / "af.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    r = cli("data", "prepare", str(tmp_path / "af.jsonl"), "-o", str(out), "--tokenizer", str(tok_dir))
    _refused(r, out, "af.jsonl:1: starts with an 'assistant' message")


def test_workers_are_bounded_by_the_cpus(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    out = tmp_path / "out"
    for n in ("0", "1000000"):
        r = cli("data", "prepare", str(tmp_path / "t.jsonl"), "-o", str(out), "--workers", n)
        _refused(r, out, f"--workers: {n}: give 1 to ")


def test_a_missing_relative_file_is_not_found_not_a_hub_name(tmp_path):
    out = tmp_path / "out"
    r = cli("data", "prepare", "data/train.jsonl", "-o", str(out))
    _refused(r, out, "inputs: data/train.jsonl not found")


def test_sources_of_different_tokenizers_are_not_mixed(tmp_path):
    a = TokenData([], 300, "a", "chat", 2, tokenizer="f00d")
    assert a.same_tokens_as(TokenData([], 300, "b", "chat", 2, tokenizer="f00d")) is None
    assert "another tokenizer" in a.same_tokens_as(TokenData([], 300, "b", "chat", 2, tokenizer="beef"))
    assert a.same_tokens_as(TokenData([], 300, "old", "chat", 2)) is None  # an index from before fingerprints
    assert "text data with vocabulary 259" in a.same_tokens_as(TokenData([], 259, "t", "text", 258))


def test_a_source_too_light_to_be_sampled_is_refused_at_plan_time(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("data:\n  sources:\n    - {path: /a, weight: 1000000}\n    - {path: /b, weight: 1}\n")
    r = cli("plan", "--gpu", "cpu", "--model", "tiny-v2", str(spec))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "data.sources" in r.stderr and "would never be sampled" in r.stderr


def test_a_cut_off_arrow_stream_is_one_line(tmp_path):
    import pyarrow as pa

    t = pa.table({"text": [f"document {i} " * 20 for i in range(5000)]})
    with pa.OSFile(str(tmp_path / "whole.arrow"), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        for b in t.to_batches(max_chunksize=500):
            w.write_batch(b)
    data = (tmp_path / "whole.arrow").read_bytes()
    (tmp_path / "cut.arrow").write_bytes(data[: len(data) // 2 + 7])
    out = tmp_path / "out"
    r = cli("data", "prepare", str(tmp_path / "cut.arrow"), "-o", str(out))
    _refused(r, out, "cut.arrow: cannot read it (damaged or cut off?)")
