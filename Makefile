# `make demo` and `make test` do all the set-up on a fresh Debian/Ubuntu machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEMO_DIR ?= demo-mesh

.PHONY: demo test install system-deps clean

# libp2p pulls in fastecdsa, which compiles against GMP; `testnet up --netns` needs
# iproute2 (`ip netns`, veth, bridge) and nftables (partitions).
SYSTEM_PACKAGES := libgmp-dev python3-venv python3-dev build-essential iproute2 nftables
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing" $$missing; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing; \
	fi

$(STAMP): pyproject.toml | system-deps
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "meshnode needs Python >= 3.11"; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(VENV)/bin/meshnode demo --dir $(DEMO_DIR)

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
