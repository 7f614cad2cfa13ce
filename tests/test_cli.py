"""The jaxckpt command: its ``main`` called in this process as the command line does (fast),
and ``python -m jaxckpt`` in a subprocess, as a user runs it, for exit codes and stderr."""

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import flip_a_chunk_byte, sharded

import jaxckpt
from jaxckpt._src.cli.main import main


def cli(*args) -> subprocess.CompletedProcess:
    """``jaxckpt ARGS``, run by ``main`` here: its exit code and what it printed."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def command(*args) -> subprocess.CompletedProcess:
    """``python -m jaxckpt ARGS`` in a subprocess, as a user runs it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "jaxckpt", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _state(mesh, scale=1.0):
    rng = np.random.default_rng(0)
    return {
        "layer": {
            "w": sharded(
                rng.standard_normal((64, 32)).astype(np.float32) * scale, mesh, ("data", "model")
            )
        },
        "b": sharded(np.arange(32, dtype=np.int32), mesh, ("model",)),
        "step": 3,
    }


@pytest.fixture
def ckpt(mesh42, tmp_path):
    jaxckpt.save(tmp_path / "c", _state(mesh42), custom_metadata={"run": "a"})
    return tmp_path / "c"


def test_ls_marks_uncommitted_leftovers(mesh42, tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, _state(mesh42), metrics={"loss": 1.0 / step})
    (tmp_path / "run" / "00000003.tmp-abcdef").mkdir()  # a save that never finished
    (tmp_path / "run" / "00000004").mkdir()  # a step without its marker
    res = cli("ls", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(ln.split()[0] == "1" and "remote" in ln and "'loss': 1.0" in ln for ln in lines), (
        res.stdout
    )
    assert any(ln.split()[0] == "2" for ln in lines)
    assert sum("uncommitted leftover" in ln for ln in lines) == 2, res.stdout


def test_info_json_fields(ckpt):
    res = cli("info", ckpt, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["format_version"] == list(jaxckpt.FORMAT_VERSION)
    assert doc["custom_metadata"] == {"run": "a"} and doc["process_count"] == 1
    assert doc["bytes"] == 64 * 32 * 4 + 32 * 4 and doc["bytes_per_process"] == [doc["bytes"]]
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    w = leaves["layer/w"]
    assert (w["shape"], w["dtype"], w["mesh"], w["spec"]) == (
        [64, 32],
        "float32",
        {"data": 4, "model": 2},
        ["data", "model"],
    )
    assert leaves["step"]["value"] == 3 and doc["writer"]["jaxckpt"]
    text = cli("info", ckpt)
    assert "layer/w" in text.stdout and "spec P('data', 'model')" in text.stdout


def test_verify_good_corrupt_and_missing(ckpt, tmp_path, mesh42):
    res = cli("verify", ckpt)
    assert res.returncode == 0 and res.stdout.startswith("ok "), res.stdout + res.stderr
    flipped, _ = flip_a_chunk_byte(ckpt)
    res = cli("verify", ckpt)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "DAMAGED" in res.stdout and "leaf 'layer/w' chunk [" in res.stdout, res.stdout
    assert f"in {flipped} (bytes " in res.stdout, res.stdout  # the data file and byte range
    # every data file gone (one process: the B-tree lives there too): exit 1, named
    for root, _, names in os.walk(ckpt / "arrays" / "d"):
        for f in names:
            os.remove(os.path.join(root, f))
    res = cli("verify", ckpt)
    assert res.returncode == 1 and "cannot list the arrays" in res.stdout, res.stdout


def test_verify_names_the_data_file_and_byte_range_of_a_corrupt_chunk(ckpt):
    """One flipped byte: verify names the leaf, the chunk, the data file and a byte range
    holding the flipped offset (from the OCDBT B-tree), and only that chunk."""
    from jaxckpt._src.cli.verify import verify

    flipped, offset = flip_a_chunk_byte(ckpt)
    (problem,) = verify(ckpt).problems
    assert problem.leaf == "layer/w" and problem.chunk is not None, problem
    assert "Digest mismatch" in problem.why, problem
    at = problem.location
    assert at is not None and at.file == str(flipped) and not at.inline, problem
    assert at.start <= offset < at.stop, (offset, at)
    assert f"{flipped} (bytes {at.start}-{at.stop - 1})" == problem.where, problem


@pytest.mark.slow
def test_verify_names_the_chunks_of_a_lost_data_file(tmp_path):
    """Process 1's data files of a 2-process save go missing: verify names every chunk
    they held, with its leaf and the process whose files are gone."""
    import multiproc

    worker = os.path.join(os.path.dirname(__file__), "workers", "data_parallel.py")
    multiproc.run(worker, 2, devices_per_process=4, args=["save", tmp_path / "c"]).check()
    lost = tmp_path / "c" / "arrays" / "p1" / "d"
    for f in os.listdir(lost):
        os.remove(lost / f)
    res = cli("verify", tmp_path / "c")
    assert res.returncode == 1, res.stdout + res.stderr
    damaged = [ln for ln in res.stdout.splitlines() if ln.startswith("DAMAGED")]
    assert damaged and all("process 1's data files" in ln for ln in damaged), res.stdout
    assert any("leaf 'params/w0' chunk [" in ln for ln in damaged), res.stdout


def test_verify_all_steps(mesh42, tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, _state(mesh42))
    res = cli("verify", tmp_path / "run", "--all")
    assert res.returncode == 0 and res.stdout.count("ok ") == 2, res.stdout
    flip_a_chunk_byte(tmp_path / "run" / "00000002")
    res = cli("verify", tmp_path / "run", "--all")
    assert res.returncode == 1 and "00000002" in res.stdout and res.stdout.count("ok ") == 1


def test_diff(mesh42, tmp_path, ckpt):
    jaxckpt.save(tmp_path / "same", _state(mesh42))
    assert cli("diff", ckpt, tmp_path / "same").returncode == 0
    jaxckpt.save(tmp_path / "near", _state(mesh42, scale=1.0 + 1e-6))
    res = cli("diff", ckpt, tmp_path / "near")
    assert res.returncode == 1 and "layer/w: max abs diff" in res.stdout, res.stdout
    res = cli("diff", ckpt, tmp_path / "near", "--rtol", "1e-5")
    assert res.returncode == 0 and "within tolerance" in res.stdout, res.stdout
    other = _state(mesh42)
    other["extra"] = np.zeros(3)
    other["b"] = sharded(np.arange(16, dtype=np.int32), mesh42, ("model",))
    jaxckpt.save(tmp_path / "other", other)
    res = cli("diff", ckpt, tmp_path / "other")
    assert res.returncode == 1
    assert (
        "extra: only in" in res.stdout and "b: array (32,) int32 -> array (16,) int32" in res.stdout
    )


def test_diff_reads_only_the_leaves_whose_fingerprints_differ(tmp_path, mesh42, monkeypatch):
    """Four leaves of 1 MiB, one changed in one element: diff names exactly that leaf, and
    the bytes read from storage (this process's rchar, no file mappings) are that leaf's
    on both sides, not the others'."""
    import iostats

    monkeypatch.setenv("JAXCKPT_MAP", "0")  # reads, not page faults, so that rchar sees them
    rng = np.random.default_rng(0)
    values = {f"w{i}": rng.standard_normal((512, 512)).astype(np.float32) for i in range(4)}
    jaxckpt.save(tmp_path / "a", {k: sharded(v, mesh42, ("data",)) for k, v in values.items()})
    values["w2"][100, 7] += 1.0
    jaxckpt.save(tmp_path / "b", {k: sharded(v, mesh42, ("data",)) for k, v in values.items()})
    before = iostats.io()["rchar"]
    res = cli("diff", tmp_path / "a", tmp_path / "b")
    read = iostats.io()["rchar"] - before
    assert res.returncode == 1, res.stdout + res.stderr
    assert [ln.split(":")[0] for ln in res.stdout.splitlines()[:-1]] == ["w2"], res.stdout
    assert "3 array leaf(s) unchanged by fingerprint (not read), 1 read" in res.stdout
    leaf = 512 * 512 * 4
    assert 2 * leaf <= read < 2 * leaf + leaf // 2, read


def test_verify_checks_the_fingerprints(ckpt):
    """Every chunk intact but the manifest's fingerprint is not the values': named."""
    res = cli("info", ckpt)
    assert "fingerprint " in res.stdout, res.stdout
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    w = next(leaf for leaf in doc["leaves"] if leaf["name"] == "layer/w")
    w["fingerprint"] = f"{int(w['fingerprint'], 16) ^ 1:016x}"
    path.write_text(json.dumps(doc))
    res = cli("verify", ckpt)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "leaf 'layer/w'" in res.stdout and "fingerprint" in res.stdout, res.stdout
    assert "leaf 'b'" not in res.stdout, res.stdout


def test_user_mistakes_print_one_line_and_exit_2(tmp_path):
    cases = (("info", tmp_path / "nope"), ("verify", tmp_path), ("ls", tmp_path))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [  # side by side: each is mostly its interpreter starting
        subprocess.Popen([sys.executable, "-m", "jaxckpt", *map(str, args)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in cases
    ]  # fmt: skip
    for args, proc in zip(cases, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert str(tmp_path) in res.stderr


def test_convert_orbax_to_jaxckpt_bit_exact(mesh42, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import orbax_states

    state = orbax_states.train_state(mesh42)
    with ocp.StandardCheckpointer() as ckptr:  # waits for its async save on exit
        ckptr.save(tmp_path / "orbax", state)
    res = cli("convert", tmp_path / "orbax", tmp_path / "jx")
    assert res.returncode == 0, res.stderr
    out = jaxckpt.restore(tmp_path / "jx")
    assert int(out["step"]) == int(state.step)
    for name in ("Dense_0", "Dense_1"):
        for leaf in ("kernel", "bias"):
            got = np.asarray(out["params"][name][leaf])
            assert got.tobytes() == np.asarray(state.params[name][leaf]).tobytes()
            mu = np.asarray(out["opt_state"][0]["mu"][name][leaf])
            assert mu.tobytes() == np.asarray(state.opt_state[0].mu[name][leaf]).tobytes()


def test_convert_jaxckpt_to_safetensors_and_back(ckpt, tmp_path):
    from safetensors.numpy import load_file

    res = cli("convert", ckpt, tmp_path / "st", "--to", "safetensors")
    assert res.returncode == 0, res.stderr
    ref = load_file(tmp_path / "st" / "model.safetensors")  # the reference reads it
    want = jaxckpt.restore(ckpt)
    assert ref.keys() == {"layer.w", "b"}
    assert ref["layer.w"].tobytes() == np.asarray(want["layer"]["w"]).tobytes()
    assert ref["b"].tobytes() == np.asarray(want["b"]).tobytes()
    res = cli("convert", tmp_path / "st", tmp_path / "back")
    assert res.returncode == 0, res.stderr
    back = jaxckpt.restore(tmp_path / "back")
    assert np.asarray(back["layer.w"]).tobytes() == ref["layer.w"].tobytes()


def test_ls_info_verify_on_s3(mesh42, s3_url):
    """The command on an object store (moto on 127.0.0.1; the AWS_* settings the fixture
    put in the environment reach the subprocess)."""
    with jaxckpt.CheckpointManager(s3_url) as mgr:
        mgr.save(1, _state(mesh42))
    res = cli("ls", s3_url)
    assert res.returncode == 0 and any(ln.split()[:1] == ["1"] for ln in res.stdout.splitlines()), (
        res
    )
    step = f"{s3_url}/00000001"
    res = cli("info", step, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["bytes"] == 64 * 32 * 4 + 32 * 4, res
    res = cli("verify", step)
    assert res.returncode == 0 and res.stdout.startswith("ok "), res.stdout + res.stderr


def test_info_and_verify_see_per_process_records(mesh42, tmp_path):
    path = tmp_path / "c"
    jaxckpt.save(path, _state(mesh42), per_process={"next_index": 3})
    res = cli("info", path)
    assert "per-process values saved by processes [0]" in res.stdout, res.stdout + res.stderr
    assert cli("verify", path).returncode == 0
    record = path / "per_process" / "00000.json"
    record.write_text(record.read_text().replace('"next_index": 3', '"next_index": 4'))
    res = cli("verify", path)
    assert res.returncode == 1 and "per_process[0]" in res.stdout, res.stdout
    assert "fails its checksum" in res.stdout, res.stdout


def test_ls_reads_local_steps_and_names_a_damaged_local_json(mesh42, tmp_path):
    """`ls` on an emergency local directory: each step's size from its checked local.json; a
    damaged one is an error naming the file (exit 2), never a traceback."""
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1, remote=jaxckpt.Options(save_interval_steps=100)
    )
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts) as mgr:
        mgr.save(1, _state(mesh42))
    step = tmp_path / "l" / "00000001"
    res = cli("ls", tmp_path / "l")
    assert res.returncode == 0 and "local" in res.stdout, res.stderr
    doc = json.loads((step / "local.json").read_text())
    del doc["leaves"]
    (step / "local.json").write_text(json.dumps(doc))
    res = cli("ls", tmp_path / "l")
    assert res.returncode == 2, res.stderr
    assert "local.json" in res.stderr and "leaves" in res.stderr and "Traceback" not in res.stderr


def test_ls_shows_a_committed_step_without_its_manifest(mesh42, tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _state(mesh42))
    (tmp_path / "run" / "00000002").mkdir()
    (tmp_path / "run" / "00000002" / "COMMITTED").touch()
    res = cli("ls", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    (broken,) = [ln for ln in res.stdout.splitlines() if ln.split()[0] == "2"]
    assert "broken" in broken and "manifest.json is missing" in broken, res.stdout
