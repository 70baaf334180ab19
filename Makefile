# The two commands of the README: `make demo` and `make test`. Both set up .venv on first use.
PY := .venv/bin/python

.PHONY: setup demo test test-quick bench bench-full proto clean

setup:
	@scripts/bootstrap.sh

demo: setup
	$(PY) examples/demo.py

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# Single-process tests only: the fast loop while developing.
test-quick: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not distributed" tests

# Side-by-side benchmarks (docs/benchmarks.md): a quick run, or the ~2 GB one on a quiet machine.
bench: setup
	$(PY) benchmarks/run.py --quick

bench-full: setup
	$(PY) benchmarks/run.py --full

# The gRPC coordinator's Python stubs, regenerated from its .proto (committed; rerun after editing it).
proto: setup
	PYTHON=$(PY) packages/bcp-core/src/bcp/coord/grpc/generate.sh

clean:
	rm -rf .venv
