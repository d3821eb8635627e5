// Command redrive is the operations Lambda (provided.al2023, bootstrap). It
// is invoked with a JSON redrive.Command, {"operation": "...", ...}:
// migrate (the CDK deploy trigger), status, dead-list, requeue-dead, replay,
// dlq-redrive, release-holds, prune; `fifobox --via-lambda` sends the same
// JSON. Every change is audited in redrive_audit and logged; a payload's actor
// is recorded as claimed ("claimed:<actor>") beside the Lambda request id.
//
// FIFOBOX_TRANSPORT (sns by default) chooses the broker side of status,
// replay and dlq-redrive: SQS queues from FIFOBOX_QUEUES, or RabbitMQ /
// NATS through their settings and secret (lambdafn.BrokerEnv), and migrate
// then also provisions the broker's topology.
//
// Environment: database as in pkg/db (FIFOBOX_DATABASE_URL, or
// FIFOBOX_DB_HOST/PORT/NAME/USER + FIFOBOX_DB_IAM_AUTH=true); FIFOBOX_QUEUES =
// {"<consumer>": {"queue_url": "...", "dlq_url": "...", "subscription_dlq_url":
// "..." (optional)}}; optional
// FIFOBOX_DEFAULT_OPERATION, used when the event names none (e.g. "migrate"
// for a deploy trigger that cannot choose its payload), checked at init. The
// handler lives in pkg/lambdafn/redrive.
package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/aws/aws-lambda-go/lambda"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	handler "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
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
	queues, err := redrive.ParseQueues(handler.Env.Get("FIFOBOX_QUEUES"))
	if err != nil {
		return nil, err
	}
	broker, err := lambdafn.BrokerFromEnv()
	if err != nil {
		return nil, err
	}
	if broker.Kind != transport.SNS && len(queues) > 0 {
		return nil, fmt.Errorf("FIFOBOX_QUEUES is set, but %s=%s: the broker's operations find its queues themselves; remove it", transport.EnvTransport, broker.Kind)
	}
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	rc := redrive.Config{Queues: queues, Logger: log}
	var sqsc redrive.SQSAPI // nil interface for brokers: their Operations do the queue work
	if broker.Kind == transport.SNS {
		sqsc = awsclient.SQS(awsCfg)
	} else {
		if err := broker.Credentials(ctx, lambdafn.SecretsManager(awsCfg)); err != nil {
			return nil, err
		}
		if rc.Broker, _, err = broker.Operations(log); err != nil {
			return nil, err
		}
		// migrate (the deploy trigger) also declares the broker's topology.
		if rc.Provisioner, err = broker.Provisioner(log); err != nil {
			return nil, err
		}
	}
	svc, err := redrive.New(pool, sqsc, rc)
	if err != nil {
		return nil, err
	}
	return handler.New(svc, cfg)
}
