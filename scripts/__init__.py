"""The repository's own tooling (release, chart digest, dependency floors), importable by the tests."""
