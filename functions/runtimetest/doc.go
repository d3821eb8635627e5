// Package runtimetest proves the artifacts a user deploys, not just the Go
// functions behind them (all of it is in the _test.go files):
//
//   - The runtime contract tests (runtime_test.go) build each Lambda
//     bootstrap exactly as `make build` does (scripts/build-lambda.sh, for
//     the host's architecture), start it as Lambda's provided.al2023 runtime
//     does, against a Runtime API (internal/lambdaruntime), PostgreSQL and
//     the SNS/SQS emulator, with the environment the synthesised CDK template
//     gives that function, and check what it answers.
//   - The environment drift tests (envdrift_test.go) compare each function's
//     Environment in the synthesised templates (infra/cdk.out,
//     infra/cdk.out.local and the broker variants infra/cdk.out.rabbitmq
//     and infra/cdk.out.nats, written by `make synth`) with the variables its
//     loaders declare (envspec.Set values: pkg/lambdafn/*.Env, pkg/db.Env,
//     pkg/metrics.Env, ...), and scan the code each binary links for reads
//     of undeclared variables.
//
// The templates come from `make synth`; without them these tests skip,
// unless FIFOBOX_REQUIRE_SYNTH=1 (set by `make test`), which makes a missing
// template a failure.
package runtimetest
