"""Speculative decoding's request fields at the router's two doors: gRPC SamplingParams and the
OpenAI body's extension fields, checked with the field named, and passed on to the workers."""

from __future__ import annotations

import jinja2
import pytest

from proto import pdserve_pb2 as pb
from router.journey_state import RouterError
from router.openai_request import BadRequest, to_grpc
from router.tokenizer import RouterTokenizer
from router.validation import validate


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> RouterTokenizer:
    return RouterTokenizer(tiny_dir)


def grpc_request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(**sampling))


def test_grpc_fields_reach_the_workers_sampling(tokenizer):
    j = validate(grpc_request(speculative_method="prompt_lookup", num_speculative_tokens=3), tokenizer, 64, 60.0)
    assert (j.sampling.speculative_method, j.sampling.num_speculative_tokens) == ("prompt_lookup", 3)
    unset = validate(grpc_request(), tokenizer, 64, 60.0)
    assert (unset.sampling.speculative_method, unset.sampling.num_speculative_tokens) == (None, None)
    off = validate(grpc_request(num_speculative_tokens=0), tokenizer, 64, 60.0)
    assert off.sampling.num_speculative_tokens == 0


@pytest.mark.parametrize("sampling, message", [
    ({"speculative_method": "eagle"}, "sampling.speculative_method must be one of none, prompt_lookup, draft, medusa"),
    ({"num_speculative_tokens": 17}, r"sampling.num_speculative_tokens must be in \[0, 16\]"),
])
def test_grpc_bad_values_are_invalid_argument(tokenizer, sampling, message):
    with pytest.raises(RouterError, match=message):
        validate(grpc_request(**sampling), tokenizer, 64, 60.0)


TEMPLATE = jinja2.Template("{{ messages }}")


def test_openai_extension_fields():
    req = to_grpc({"prompt": "x", "speculative_method": "prompt_lookup", "num_speculative_tokens": 2}, False,
                  "m", TEMPLATE)
    assert (req.sampling.speculative_method, req.sampling.num_speculative_tokens) == ("prompt_lookup", 2)
    plain = to_grpc({"prompt": "x"}, False, "m", TEMPLATE)
    assert not plain.sampling.HasField("speculative_method") and not plain.sampling.HasField("num_speculative_tokens")


@pytest.mark.parametrize("body, param", [
    ({"speculative_method": "ngram"}, "speculative_method"),
    ({"speculative_method": ["prompt_lookup"]}, "speculative_method"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
])
def test_openai_bad_values_name_the_field(body, param):
    with pytest.raises(BadRequest) as err:
        to_grpc({"prompt": "x", **body}, False, "m", TEMPLATE)
    assert err.value.param == param and err.value.status == 400


def test_the_fallback_method_passes_both_doors(tokenizer):
    j = validate(grpc_request(speculative_method="prompt_lookup+draft"), tokenizer, 64, 60.0)
    assert j.sampling.speculative_method == "prompt_lookup+draft"
    req = to_grpc({"prompt": "x", "speculative_method": "prompt_lookup+draft"}, False, "m", TEMPLATE)
    assert req.sampling.speculative_method == "prompt_lookup+draft"
