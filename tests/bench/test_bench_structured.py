"""`strata bench structured`'s pieces: its default schema is a valid 20-property JSON schema the engine
compiles, and the engine's mask figures are read from two scrapes of its /metrics."""

import json

import jsonschema

from services.bench.server_metrics import parse_metrics
from services.bench.structured import _engine_mask_figures, default_schema, response_format
from services.engine.structured_output.constraint import Constraint
from services.engine.structured_output.manager import StructuredOutputManager


def test_the_default_schema_has_20_properties_and_compiles(default_model_dir):
    schema = default_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert len(schema["properties"]) == 20
    assert default_schema("_x") != schema  # a suffix makes a schema the engine has not seen
    assert response_format(schema)["response_format"]["json_schema"]["schema"] == schema
    StructuredOutputManager(str(default_model_dir), 4096, (2,)).check(Constraint("json_schema", json.dumps(schema)))


def test_mask_figures_are_per_constrained_step():
    def scrape(steps, fill, wait, compiled):
        return parse_metrics(
            "# TYPE strata:structured_output_mask_seconds histogram\n"
            f'strata:structured_output_mask_seconds_count{{model_name="m"}} {steps}\n'
            f'strata:structured_output_mask_seconds_sum{{model_name="m"}} {fill}\n'
            "# TYPE strata:structured_output_mask_wait_seconds histogram\n"
            f'strata:structured_output_mask_wait_seconds_count{{model_name="m"}} {steps}\n'
            f'strata:structured_output_mask_wait_seconds_sum{{model_name="m"}} {wait}\n'
            "# TYPE strata:structured_output_compile_seconds histogram\n"
            f'strata:structured_output_compile_seconds_count{{model_name="m"}} {compiled}\n'
            f'strata:structured_output_compile_seconds_sum{{model_name="m"}} 0.01\n')

    line = _engine_mask_figures(scrape(10, 0.01, 0.0, 1), scrape(110, 0.21, 0.05, 2))
    assert "(100 steps)" in line and "filled in 2.00 ms" in line and "0.50 ms waited" in line
    assert "1 grammars compiled" in line
    assert _engine_mask_figures(scrape(10, 0.01, 0.0, 1), scrape(10, 0.01, 0.0, 1)) == ""
