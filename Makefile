# The two commands of the README: `make demo` and `make test`. Both set up .venv on first use.
PY := .venv/bin/python

.PHONY: setup demo test test-quick bench bench-full bench-docs gpu-check proto clean

setup:
	@scripts/bootstrap.sh

demo: setup
	$(PY) examples/demo.py

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# Single-process tests only: the fast loop while developing.
test-quick: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not distributed" tests

# Side-by-side benchmarks: a quick run, or the ~2 GB one on a quiet machine. Both write their report
# under benchmarks/results/ (ignored by git) and print the targets; neither touches docs/.
bench: setup
	$(PY) benchmarks/run.py --quick

bench-full: setup
	$(PY) benchmarks/run.py --full

# docs/benchmarks.md's generated blocks from the newest full run (or RESULT=benchmarks/results/<run>.json).
bench-docs: setup
	$(PY) benchmarks/publish.py $(RESULT)

# On a CUDA machine: the accelerator tests and a short benchmark against the hardware's floors and DCP,
# with the interpreter that holds CUDA torch (PYTHON=..., default python3), not .venv; elsewhere it
# says it skips. See docs/benchmarks.md, "On a GPU".
gpu-check:
	@scripts/gpu_check.sh

# The gRPC coordinator's Python stubs, regenerated from its .proto (committed; rerun after editing it).
proto: setup
	PYTHON=$(PY) packages/bcp-core/src/bcp/coord/grpc/generate.sh

clean:
	rm -rf .venv
