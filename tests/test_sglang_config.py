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


def test_the_metrics_keys_are_accepted():
    """tbo's figures reach SGLang's /metrics (docs/metrics.md, SGLang): the keys are taken as vLLM takes them; a
    server without --enable-metrics refuses an explicit ``"metrics": true`` when its scheduler starts."""
    from tbo.integrations.sglang.config import parse_config

    assert parse_config('{"metrics": false}').metrics is False and parse_config("{}").metrics is True
    config = parse_config('{"metrics": true, "metrics_interval_s": 0.5}')
    assert config.metrics is True and config.metrics_interval_s == 0.5 and "metrics" in config.model_fields_set
