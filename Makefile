# fifobox: the two commands that matter on a fresh machine are
#   make local   run the whole pipeline locally (PostgreSQL + SNS/SQS emulator)
#   make test    run every test (installs and starts what the tests need)
SHELL := /bin/bash
GO    ?= go
export CDK_DISABLE_CLI_TELEMETRY := true
FUNCTIONS := dispatcher consumer redrive

.PHONY: help local test test-go test-containers test-infra bench fuzz vet migrate build synth deploy deploy-local emulator-up emulator-down docs clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

local: ## run the pipeline end to end on this machine; it stays up until Ctrl-C (ARGS=-exit-when-drained stops after the demo)
	./scripts/local.sh $(ARGS)

test: ## every test: PostgreSQL, emulator and CDK included (what CI runs)
	./scripts/test.sh

test-go: ## application module tests only (expects PostgreSQL and the emulator up)
	$(GO) test -count=1 ./...

test-containers: ## tests with PostgreSQL and Floci/LocalStack in Docker (testcontainers-go), no local services needed
	FIFOBOX_TESTCONTAINERS=1 $(GO) test -tags testcontainers -count=1 ./...

test-infra: ## CDK assertions, cdk-nag and cfn-guard (AWS Control Tower rules) tests (infra/ module)
	./infra/scripts/test.sh

bench: ## benchmarks: dispatcher vs raw SQL limit, publisher, consumer
	./scripts/bench.sh

fuzz: ## fuzz the envelope decoder and the validate-encode-decode round trip, 60s each
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime 60s ./pkg/envelope
	$(GO) test -run '^$$' -fuzz FuzzRoundTrip -fuzztime 60s ./pkg/envelope

vet: ## go vet both modules
	$(GO) vet ./...
	cd infra && $(GO) vet ./...

migrate: ## apply migrations to FIFOBOX_DATABASE_URL (default: local fifobox database)
	$(GO) run ./cmd/fifobox migrate

build: ## Lambda bootstrap binaries (linux/arm64) in build/lambda/<function>/bootstrap
	GO=$(GO) ./scripts/build-lambda.sh build/lambda $(FUNCTIONS)

synth: build ## cdk synth of all stacks (offline, no AWS account needed)
	./infra/scripts/synth.sh

deploy: build ## cdk deploy to the AWS account in your environment
	./infra/scripts/deploy.sh

deploy-local: build ## cdklocal deploy of the local variant to LocalStack/Floci
	./infra/scripts/deploy-local.sh

docs: ## refresh the documented outputs (docs/testdata, and the blocks in README.md and docs/) from what the code prints now
	./scripts/ensure-postgres.sh
	./localstack/emulator.sh status >/dev/null 2>&1 || ./localstack/emulator.sh start
	source ./localstack/env.sh && FIFOBOX_UPDATE_DOCS=1 $(GO) test -count=1 -run 'TestDocOutputs' ./docs/
	@git status --short README.md docs

emulator-up: ## install (first time) and start the SNS/SQS emulator on 127.0.0.1:4566
	./localstack/emulator.sh start

emulator-down: ## stop the emulator
	./localstack/emulator.sh stop

clean:
	rm -rf build infra/cdk.out
