"""The run config: the schema (schema, and env for an environment entry), loading files and overrides
(files), checks that need environments, renderers or models (checks), error messages (errors) and
``--help-config``'s reference (reference)."""
