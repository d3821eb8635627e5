// Package containers starts the integration tests' dependencies in Docker
// with testcontainers-go, for machines that have Docker but neither a local
// PostgreSQL nor the npm emulator. It is opt-in: FIFOBOX_TESTCONTAINERS=1,
// and the tests built with -tags testcontainers (make test-containers), so
// the default build carries no Docker client. Without it the tests use the
// endpoints from the environment (or the local defaults) and log which.
package containers

import (
	"context"
	"errors"
	"os"
)

// Kinds of container.
const (
	Postgres = "postgres" // PostgreSQL 15, trust auth, database "test"
	Emulator = "emulator" // Floci, or LocalStack when LOCALSTACK_AUTH_TOKEN is set: SNS/SQS on :4566
)

// Enabled reports whether tests should start containers (FIFOBOX_TESTCONTAINERS=1).
func Enabled() bool { return os.Getenv("FIFOBOX_TESTCONTAINERS") == "1" }

// start is set by the testcontainers build (containers_tc.go).
var start func(ctx context.Context, kind string) (string, error)

// Start starts a container of kind and returns its URL (a PostgreSQL
// connection string, or the AWS endpoint). The container lives until the
// test process exits (testcontainers' reaper removes it).
func Start(ctx context.Context, kind string) (string, error) {
	if start == nil {
		return "", errors.New("FIFOBOX_TESTCONTAINERS=1 needs the tests built with -tags testcontainers (make test-containers)")
	}
	return start(ctx, kind)
}
