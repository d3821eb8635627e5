// Command dispatcher is the dispatcher Lambda (provided.al2023, bootstrap):
// on each EventBridge Scheduler tick it publishes outbox events until shortly
// before its deadline: to the SNS FIFO topic (the default), or to RabbitMQ
// (Amazon MQ) or NATS JetStream when FIFOBOX_TRANSPORT says so. Everything
// is built once at init; the handler lives in pkg/lambdafn/dispatcher.
//
// Environment: FIFOBOX_TRANSPORT (sns, rabbitmq or nats; default sns);
// with sns FIFOBOX_TOPIC_ARN (required); with rabbitmq FIFOBOX_AMQP_URL,
// FIFOBOX_AMQP_TOPOLOGY and FIFOBOX_AMQP_SECRET_ARN; with nats
// FIFOBOX_NATS_URL, FIFOBOX_NATS_TOPOLOGY and FIFOBOX_NATS_SECRET_ARN (see
// lambdafn.BrokerEnv); database: FIFOBOX_DATABASE_URL, or FIFOBOX_DB_HOST,
// FIFOBOX_DB_PORT, FIFOBOX_DB_NAME, FIFOBOX_DB_USER, FIFOBOX_DB_IAM_AUTH
// (see pkg/db); optional knobs: FIFOBOX_BATCH_SIZE,
// FIFOBOX_PUBLISH_CONCURRENCY, FIFOBOX_MAX_ATTEMPTS, FIFOBOX_POLL_INTERVAL,
// FIFOBOX_DEADLINE_MARGIN, FIFOBOX_METRICS_INTERVAL,
// FIFOBOX_METRICS_NAMESPACE.
package main

import (
	"context"
	"log/slog"

	"github.com/aws/aws-lambda-go/lambda"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/snspub"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/wire"
)

func main() {
	log := lambdafn.Logger()
	h, err := setup(context.Background())
	if err != nil {
		lambdafn.InitFailed(log, "dispatcher", err)
	}
	lambda.Start(h.Handle)
}

func setup(ctx context.Context) (*dispatcher.Handler, error) {
	cfg, err := dispatcher.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	broker, err := lambdafn.BrokerFromEnv()
	if err != nil {
		return nil, err
	}
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	var pub outbox.Publisher
	if cfg.Transport == transport.SNS {
		var w *wire.Mapper
		if w, err = wire.MapperFromEnv(wire.TransportSNS); err == nil {
			pub, err = snspub.New(awsclient.SNS(awsCfg), snspub.Config{TopicARN: cfg.TopicARN, Wire: w})
		}
	} else if err = broker.Credentials(ctx, lambdafn.SecretsManager(awsCfg)); err == nil {
		pub, _, err = broker.Publisher(slog.Default()) // kept for the environment's lifetime
	}
	if err != nil {
		return nil, err
	}
	return dispatcher.New(pool, pub, metrics.FromEnv(), cfg)
}
