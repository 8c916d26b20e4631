"""What the grammar engine is told about a JSON Schema before it compiles it: the schema must
be valid (checked against its draft's meta-schema with `jsonschema`) and use only keywords
xgrammar 0.2.8 enforces. xgrammar silently drops the others (its grammar is the same with or
without them), so a schema with one would be followed only in part; it is refused instead."""

from typing import Any

from engine.errors import InvalidRequestError

# Keywords xgrammar 0.2.8 ignores (found by compiling each schema with and without the keyword:
# the same grammar came out). Annotations (title, description, default, examples, ...) are
# ignored too, and rightly: they constrain nothing.
UNSUPPORTED_KEYWORDS = {
    "not": "negation",
    "if": "conditionals",
    "then": "conditionals",
    "else": "conditionals",
    "dependentRequired": "dependencies",
    "dependentSchemas": "dependencies",
    "dependencies": "dependencies",
    "propertyNames": "property-name schemas",
    "unevaluatedProperties": "unevaluated properties",
    "unevaluatedItems": "unevaluated items",
    "uniqueItems": "unique items",
    "contains": "contains",
    "minContains": "contains",
    "maxContains": "contains",
}
# `format` values xgrammar turns into a grammar; any other format would be ignored.
SUPPORTED_FORMATS = {
    "date",
    "time",
    "date-time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
    "json-pointer",
    "relative-json-pointer",
}
# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_SCHEMA = ("items", "additionalProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema: dict[str, Any] | bool) -> None:
    """Raise InvalidRequestError naming the problem (and where) unless xgrammar can follow
    `schema` whole."""
    import jsonschema

    if isinstance(schema, bool):
        return
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise InvalidRequestError(
            f"structured_outputs: json is not a valid JSON Schema: {e.message}"
            + (f" (at #/{where})" if where else "")
        ) from None
    _check_keywords(schema, "#")


def _check_keywords(schema: Any, where: str) -> None:
    if isinstance(schema, list):  # drafts 4-7: "items" as a list of schemas
        for i, sub in enumerate(schema):
            _check_keywords(sub, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key in schema:
        if key in UNSUPPORTED_KEYWORDS:
            raise InvalidRequestError(
                f"structured_outputs: the JSON Schema keyword {key!r} (at {where}, "
                f"{UNSUPPORTED_KEYWORDS[key]}) is not supported by the grammar engine "
                "(xgrammar); remove it or express the constraint another way"
            )
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        raise InvalidRequestError(
            f"structured_outputs: JSON Schema format {fmt!r} (at {where}) is not supported by "
            f"the grammar engine (xgrammar); supported: {', '.join(sorted(SUPPORTED_FORMATS))}"
        )
    for key in _SCHEMA:
        _check_keywords(schema.get(key), f"{where}/{key}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            _check_keywords(sub, f"{where}/{key}/{i}")
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                _check_keywords(s, f"{where}/{key}/{name}")
