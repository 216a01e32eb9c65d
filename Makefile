# The two commands of the README: `make run` and `make test`.
.PHONY: setup run test lint

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/forecache run

test: setup
	.venv/bin/python -m forecache.build --reference
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check forecache tests benchmarks
