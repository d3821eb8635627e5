// Package lambdafn holds what the Lambda commands (functions/*) share at
// init; each function's handler lives in a subpackage.
package lambdafn

import (
	"context"
	"log/slog"
	"os"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/db"
)

// Logger returns the JSON logger every function writes to (CloudWatch Logs)
// and makes it the default.
func Logger() *slog.Logger {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	slog.SetDefault(log)
	return log
}

// InitTimeout bounds Connect. Lambda allows a function's init 10 s in all
// (then it restarts the init inside the first invocation's time); the rest
// is left for the runtime and the handler's own setup.
const InitTimeout = 7 * time.Second

// Connect reads the database and AWS configuration from the environment
// (pkg/db, pkg/awsclient) and opens the pool, minting IAM tokens from the
// same credentials, within InitTimeout. Called once per cold start.
func Connect(ctx context.Context) (*pgxpool.Pool, aws.Config, error) {
	ctx, cancel := context.WithTimeout(ctx, InitTimeout)
	defer cancel()
	dbc, err := db.FromEnv()
	if err != nil {
		return nil, aws.Config{}, err
	}
	awsCfg, err := awsclient.Load(ctx)
	if err != nil {
		return nil, aws.Config{}, err
	}
	pool, err := db.Open(ctx, dbc, awsCfg.Credentials)
	if err != nil {
		return nil, aws.Config{}, err
	}
	return pool, awsCfg, nil
}
