// Command consumer is the example consumer Lambda (provided.al2023,
// bootstrap). Each record's side effect runs in one transaction with its
// inbox row (pkg/inbox), so it applies once however often it is delivered.
// The side effect is chosen by consumer name (readmodel.ForConsumer):
// orders-projection keeps orders_read_model current.
//
// Its event source is chosen by FIFOBOX_TRANSPORT: sns (the default) is an
// SQS FIFO event source mapping with ReportBatchItemFailures; rabbitmq is
// Lambda's Amazon MQ event source, which has no partial batch response, so
// the handler settles every record itself (pkg/lambdafn/consumer.AMQPHandler).
//
// Environment: FIFOBOX_CONSUMER_NAME (required), FIFOBOX_TRANSPORT; with
// sns FIFOBOX_DLQ_URL (required), FIFOBOX_CONSUMER_ORDER (strict, the
// default, or relaxed), FIFOBOX_MAX_RECEIVE_COUNT (the queue's
// maxReceiveCount); with rabbitmq FIFOBOX_AMQP_URL, FIFOBOX_AMQP_TOPOLOGY,
// FIFOBOX_AMQP_SECRET_ARN (lambdafn.BrokerEnv); FIFOBOX_DEADLINE_MARGIN
// (default 3s), FIFOBOX_LOG_AGGREGATE_IDS (default false); database as in
// pkg/db (FIFOBOX_DATABASE_URL, or FIFOBOX_DB_HOST/PORT/NAME/USER with
// FIFOBOX_DB_IAM_AUTH=true); FIFOBOX_METRICS_NAMESPACE (default Fifobox).
package main

import (
	"context"
	"log/slog"

	"github.com/aws/aws-lambda-go/lambda"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/lambdafn/consumer"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/transport"
)

func main() {
	log := lambdafn.Logger()
	h, err := setup(context.Background(), log)
	if err != nil {
		lambdafn.InitFailed(log, "consumer", err)
	}
	lambda.Start(h)
}

// setup returns the handler for the configured event source.
func setup(ctx context.Context, log *slog.Logger) (any, error) {
	cfg, err := consumer.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	cfg.Logger = log
	broker, err := lambdafn.BrokerFromEnv()
	if err != nil {
		return nil, err
	}
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	apply := readmodel.ForConsumer(cfg.Consumer)
	if cfg.Transport == transport.RabbitMQ {
		if err := broker.Credentials(ctx, lambdafn.SecretsManager(awsCfg)); err != nil {
			return nil, err
		}
		h, err := consumer.NewAMQP(pool, apply, broker.AMQP, metrics.FromEnv(), cfg)
		if err != nil {
			return nil, err
		}
		return h.Handle, nil
	}
	h, err := consumer.New(pool, awsclient.SQS(awsCfg), apply, metrics.FromEnv(), cfg)
	if err != nil {
		return nil, err
	}
	return h.Handle, nil
}
