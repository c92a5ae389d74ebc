"""The SGLang plugin's config without SGLang: ``TBO_SGLANG_CONFIG`` holds vLLM's ``additional_config["tbo"]`` schema,
every bad key or value refused by name (the schema's and the SGLang room's own refusals), and unset or empty leaves
the plugin idle. The engine-start refusals, through real SGLang engines, are tests/sglang/test_refusals.py."""

from __future__ import annotations

import pytest

@pytest.mark.parametrize("text, named", [
    ('{"strategy": "qwen3_moe_decod"}', "strategy"),
    ('{"num_microbatches": 1}', "num_microbatches"),
    ('{"link": "fast"}', "link"),
    ('{"backend": "deepep"}', "backend='deepep'"),
    ('{"afd": {"ffn": "127.0.0.1:1"}}', "afd"),
    ('{"metrics": true}', "metrics=True"),
    ('{"metrics_interval_s": 5}', "metrics_interval_s=5"),
    ('[1, 2]', "JSON object"),
    ('{"split": ', "not JSON"),
])
def test_bad_values_are_refused_by_name(text, named):
    from tbo.integrations.sglang.config import parse_config
    from tbo.integrations.sglang.errors import TboSglangError

    with pytest.raises(TboSglangError, match="TBO_SGLANG_CONFIG") as info:
        parse_config(text)
    assert named in str(info.value)


def test_unset_or_empty_leaves_the_plugin_idle():
    from tbo.integrations.sglang.config import read

    assert read({}) is None and read({"TBO_SGLANG_CONFIG": " "}) is None
    assert read({"TBO_SGLANG_CONFIG": "{}"}).num_microbatches == 2


def test_metrics_off_is_accepted():
    from tbo.integrations.sglang.config import parse_config

    assert parse_config('{"metrics": false}').metrics is False and parse_config("{}").metrics is True
