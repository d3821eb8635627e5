// Command consumer is the example consumer Lambda (provided.al2023,
// bootstrap). Each record's side effect runs in one transaction with its
// inbox row (pkg/inbox), so it applies once however often it is delivered.
// The side effect is chosen by consumer name (readmodel.ForConsumer):
// orders-projection keeps orders_read_model current.
//
// Its event source is the transport's (FIFOBOX_TRANSPORT): sns (the
// default) is an SQS FIFO event source mapping with ReportBatchItemFailures;
// rabbitmq is Lambda's Amazon MQ event source, which has no partial batch
// response, so the handler settles every record itself. NATS has none (its
// consumers run `fifobox consume`).
//
// Environment: FIFOBOX_CONSUMER_NAME (required), FIFOBOX_DEADLINE_MARGIN
// (default 3s), FIFOBOX_LOG_AGGREGATE_IDS (default false); FIFOBOX_TRANSPORT
// and that transport's settings (transport.RegisteredEnv: with sns
// FIFOBOX_DLQ_URL, required, FIFOBOX_CONSUMER_ORDER, FIFOBOX_MAX_RETRIES, FIFOBOX_MAX_RECEIVE_COUNT;
// with rabbitmq FIFOBOX_AMQP_URL, FIFOBOX_AMQP_TOPOLOGY,
// FIFOBOX_AMQP_SECRET_ARN); database as in pkg/db (FIFOBOX_DATABASE_URL, or
// FIFOBOX_DB_HOST/PORT/NAME/USER with FIFOBOX_DB_IAM_AUTH=true);
// FIFOBOX_METRICS_NAMESPACE (default Fifobox).
package main

import (
	"context"
	"log/slog"

	"github.com/aws/aws-lambda-go/lambda"

	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/lambdafn/consumer"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/readmodel"
)

func main() {
	log := lambdafn.Logger()
	h, err := setup(context.Background(), log)
	if err != nil {
		lambdafn.InitFailed(log, "consumer", err)
	}
	lambda.Start(h)
}

// setup returns the handler for the transport's event source.
func setup(ctx context.Context, log *slog.Logger) (any, error) {
	cfg, err := consumer.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	cfg.Logger = log
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	t, err := lambdafn.OpenTransport(ctx, awsCfg)
	if err != nil {
		return nil, err
	}
	return consumer.New(t, pool, readmodel.ForConsumer(cfg.Consumer), metrics.FromEnv(), cfg)
}
