// Command redrive is the operations Lambda (provided.al2023, bootstrap). It
// is invoked with a JSON redrive.Command, {"operation": "...", ...}:
// migrate (the CDK deploy trigger), status, dead-list, requeue-dead, replay,
// dlq-redrive, release-holds, prune; `fifobox --via-lambda` sends the same
// JSON. Every change is audited in redrive_audit and logged; a payload's actor
// is recorded as claimed ("claimed:<actor>") beside the Lambda request id.
//
// The broker side of status, replay and dlq-redrive goes through the
// transport FIFOBOX_TRANSPORT names (sns by default: the SQS queues of
// FIFOBOX_QUEUES); with a broker transport, migrate also provisions the
// broker's topology (CDK creates the SNS and SQS resources itself).
//
// Environment: database as in pkg/db (FIFOBOX_DATABASE_URL, or
// FIFOBOX_DB_HOST/PORT/NAME/USER + FIFOBOX_DB_IAM_AUTH=true);
// FIFOBOX_TRANSPORT and that transport's settings (transport.RegisteredEnv:
// with sns FIFOBOX_QUEUES = {"<consumer>": {"queue_url": "...", "dlq_url":
// "...", "subscription_dlq_url": "..." (optional)}}); FIFOBOX_INBOX_TABLE as
// the consumer functions have it (dlq-discard marks events handled there); optional
// FIFOBOX_DEFAULT_OPERATION, used when the event names none (e.g. "migrate"
// for a deploy trigger that cannot choose its payload), checked at init. The
// handler lives in pkg/lambdafn/redrive.
package main

import (
	"context"
	"log/slog"

	"github.com/aws/aws-lambda-go/lambda"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	handler "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport"
)

func main() {
	log := lambdafn.Logger()
	h, err := setup(context.Background(), log)
	if err != nil {
		lambdafn.InitFailed(log, "redrive", err)
	}
	lambda.Start(h) // Handler.Invoke: an empty payload runs the default operation
}

func setup(ctx context.Context, log *slog.Logger) (*handler.Handler, error) {
	cfg, err := handler.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	t, err := lambdafn.OpenTransport(ctx, awsCfg)
	if err != nil {
		return nil, err
	}
	// The consumer functions deployed beside this one run the example side
	// effects (readmodel.ForConsumer): their table is the deployment's, not
	// a fifobox migration's.
	rc := redrive.Config{Logger: log, Transport: string(t.Kind()),
		AfterMigrate: func(ctx context.Context, pool *pgxpool.Pool) error { return readmodel.Setup(ctx, pool) }}
	if rc.Operations, err = t.Operations(); err != nil {
		return nil, err
	}
	// dlq-discard marks discarded events handled in the consumers' inbox
	// table, configured as the consumer functions' (FIFOBOX_INBOX_TABLE).
	if rc.Inbox, err = inbox.TableFromEnv(); err != nil {
		return nil, err
	}
	// migrate (the deploy trigger) also declares a broker's topology; the
	// SNS topic and SQS queues are the CDK stack's own resources.
	if t.Kind() != transport.SNS {
		if rc.Provisioner, err = t.Provisioner(); err != nil {
			return nil, err
		}
	}
	svc, err := redrive.New(pool, rc)
	if err != nil {
		return nil, err
	}
	return handler.New(svc, cfg)
}
