"""The fixed API contract (protos/llm/v1): names, field numbers, HTTP mappings."""

from __future__ import annotations

import pytest
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FileDescriptor

from common.config import ROOT
from llm.v1 import admin_pb2, common_pb2, engine_pb2, gateway_pb2, tokenizer_pb2

FILES: dict[str, FileDescriptor] = {
    "gateway": gateway_pb2.DESCRIPTOR,
    "admin": admin_pb2.DESCRIPTOR,
    "engine": engine_pb2.DESCRIPTOR,
    "tokenizer": tokenizer_pb2.DESCRIPTOR,
}

RPCS = {
    ("gateway", "Gateway"): {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "ListModels": ("ListModelsRequest", "ListModelsResponse", False),
    },
    ("engine", "Engine"): {
        "Generate": ("EngineGenerateRequest", "EngineGenerateResponse", True),
        "GetStats": ("GetStatsRequest", "EngineStats", False),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
    },
    ("tokenizer", "Tokenizer"): {
        "Encode": ("EncodeRequest", "EncodeResponse", False),
        "Decode": ("DecodeRequest", "DecodeResponse", False),
        "CountTokens": ("EncodeRequest", "CountTokensResponse", False),
    },
    ("admin", "RateLimitAdmin"): {
        "UpsertTenant": ("Tenant", "Tenant", False),
        "GetTenant": ("GetTenantRequest", "Tenant", False),
        "ListTenants": ("ListTenantsRequest", "ListTenantsResponse", False),
        "DeleteTenant": ("DeleteTenantRequest", "DeleteTenantResponse", False),
        "CreateApiKey": ("CreateApiKeyRequest", "CreateApiKeyResponse", False),
        "RevokeApiKey": ("RevokeApiKeyRequest", "RevokeApiKeyResponse", False),
        "GetUsage": ("GetUsageRequest", "TenantUsage", False),
        "ResetLimits": ("ResetLimitsRequest", "ResetLimitsResponse", False),
        "UpdateTenant": ("UpdateTenantRequest", "Tenant", False),
        "UpdateApiKey": ("UpdateApiKeyRequest", "ApiKey", False),
        "RotateApiKey": ("RotateApiKeyRequest", "RotateApiKeyResponse", False),
    },
}

FIELDS: dict[Descriptor, dict[str, int]] = {
    gateway_pb2.GenerateRequest.DESCRIPTOR: {
        "model": 1,
        "prompt": 2,
        "messages": 3,
        "sampling": 4,
        "request_id": 5,
    },
    gateway_pb2.GenerateResponse.DESCRIPTOR: {
        "request_id": 1,
        "text": 2,
        "token_ids": 3,
        "finish_reason": 4,
        "usage": 5,
    },
    common_pb2.SamplingParams.DESCRIPTOR: {
        "max_tokens": 1,
        "temperature": 2,
        "top_p": 3,
        "top_k": 4,
        "seed": 5,
        "stop": 6,
        "repetition_penalty": 7,
        "presence_penalty": 8,
        "frequency_penalty": 9,
        "min_tokens": 10,
        "logprobs": 11,
    },
    common_pb2.Usage.DESCRIPTOR: {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "cached_prompt_tokens": 3,
    },
    common_pb2.ChatMessage.DESCRIPTOR: {"role": 1, "content": 2},
    common_pb2.ChatMessages.DESCRIPTOR: {"messages": 1},
    admin_pb2.Tenant.DESCRIPTOR: {"id": 1, "limits": 2, "priority": 3},
    admin_pb2.LimitPolicy.DESCRIPTOR: {
        "requests_per_minute": 1,
        "tokens_per_minute": 2,
        "max_concurrent": 3,
    },
}


@pytest.mark.parametrize(("where", "rpcs"), RPCS.items(), ids=lambda x: str(x))
def test_services_and_rpcs(where: tuple[str, str], rpcs: dict[str, tuple[str, str, bool]]) -> None:
    svc = FILES[where[0]].services_by_name[where[1]]
    assert svc.full_name == f"llm.v1.{where[1]}"
    for name, (req, resp, streaming) in rpcs.items():
        m = svc.methods_by_name[name]
        assert (m.input_type.name, m.output_type.name) == (req, resp)
        assert m.server_streaming is streaming


@pytest.mark.parametrize("desc", FIELDS, ids=lambda d: d.name)
def test_field_numbers(desc: Descriptor) -> None:
    assert {f.name: f.number for f in desc.fields if f.name in FIELDS[desc]} == FIELDS[desc]


def test_enums() -> None:
    assert dict(common_pb2.FinishReason.items()) == {
        "FINISH_REASON_UNSPECIFIED": 0,
        "STOP": 1,
        "LENGTH": 2,
        "CANCELLED": 3,
        "ERROR": 4,
        "TOOL_CALLS": 5,
    }
    assert dict(common_pb2.Priority.items()) == {
        "PRIORITY_UNSPECIFIED": 0,
        "LOW": 1,
        "NORMAL": 2,
        "CRITICAL": 3,
    }
    assert common_pb2.SamplingParams.DESCRIPTOR.fields_by_name["seed"].has_presence


def test_admin_rpcs_have_http_rules_under_v1_admin() -> None:
    svc = admin_pb2.DESCRIPTOR.services_by_name["RateLimitAdmin"]
    for m in svc.methods:
        rule: http_pb2.HttpRule = m.GetOptions().Extensions[annotations_pb2.http]
        path = getattr(rule, rule.WhichOneof("pattern"))
        assert path.startswith("/v1/admin/"), m.name


def test_descriptor_set_for_envoy_holds_every_service() -> None:
    fds = descriptor_pb2.FileDescriptorSet.FromString((ROOT / "build/llm_v1.pb").read_bytes())
    names = {f"{f.package}.{s.name}" for f in fds.file for s in f.service}
    assert {"llm.v1.Gateway", "llm.v1.RateLimitAdmin", "llm.v1.Engine", "llm.v1.Tokenizer"} <= names
    assert "google/api/annotations.proto" in {f.name for f in fds.file}  # imports included
