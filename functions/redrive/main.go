// Command redrive is the operations Lambda (provided.al2023, bootstrap). It
// is invoked with a JSON redrive.Command, {"operation": "...", ...}:
// migrate (the CDK deploy trigger), status, dead-list, requeue-dead, replay,
// dlq-redrive, prune; `fifobox --via-lambda` sends the same JSON. Every change
// is audited in redrive_audit and logged.
//
// Environment: database as in pkg/db (FIFOBOX_DATABASE_URL, or
// FIFOBOX_DB_HOST/PORT/NAME/USER + FIFOBOX_DB_IAM_AUTH=true); FIFOBOX_QUEUES =
// {"<consumer>": {"queue_url": "...", "dlq_url": "..."}}; optional
// FIFOBOX_DEFAULT_OPERATION, used when the event names none (e.g. "migrate"
// for a deploy trigger that cannot choose its payload).
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/aws/aws-lambda-go/lambda"
	"github.com/aws/aws-lambda-go/lambdacontext"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/redrive"
)

func main() {
	log := lambdafn.Logger()
	svc, err := setup(context.Background(), log)
	if err != nil {
		log.Error("redrive init failed", "error", err.Error())
		os.Exit(1)
	}
	def := os.Getenv("FIFOBOX_DEFAULT_OPERATION")
	lambda.Start(func(ctx context.Context, cmd redrive.Command) (redrive.Result, error) {
		if cmd.Operation == "" {
			cmd.Operation = def
		}
		if lc, ok := lambdacontext.FromContext(ctx); ok {
			cmd.RequestID = lc.AwsRequestID
		}
		if cmd.Actor == "" {
			cmd.Actor = "lambda:" + lambdacontext.FunctionName
		}
		return svc.Execute(ctx, cmd)
	})
}

func setup(ctx context.Context, log *slog.Logger) (*redrive.Service, error) {
	queues, err := redrive.QueuesFromEnv()
	if err != nil {
		return nil, err
	}
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return redrive.New(pool, awsclient.SQS(awsCfg), redrive.Config{Queues: queues, Logger: log})
}
