// Command dispatcher is the dispatcher Lambda (provided.al2023, bootstrap):
// on each EventBridge Scheduler tick it publishes outbox events until shortly
// before its deadline, through the transport FIFOBOX_TRANSPORT names: the
// SNS FIFO topic (the default), RabbitMQ (Amazon MQ) or NATS JetStream.
// Everything is built once at init; the handler lives in
// pkg/lambdafn/dispatcher.
//
// Environment: FIFOBOX_TRANSPORT and that transport's settings
// (transport.RegisteredEnv: with sns FIFOBOX_TOPIC_ARN, required; with
// rabbitmq FIFOBOX_AMQP_URL, FIFOBOX_AMQP_TOPOLOGY, FIFOBOX_AMQP_SECRET_ARN;
// with nats FIFOBOX_NATS_URL, FIFOBOX_NATS_TOPOLOGY, FIFOBOX_NATS_SECRET_ARN);
// database: FIFOBOX_DATABASE_URL, or FIFOBOX_DB_HOST, FIFOBOX_DB_PORT,
// FIFOBOX_DB_NAME, FIFOBOX_DB_USER, FIFOBOX_DB_IAM_AUTH (see pkg/db);
// optional knobs: FIFOBOX_BATCH_SIZE, FIFOBOX_PUBLISH_CONCURRENCY,
// FIFOBOX_MAX_ATTEMPTS, FIFOBOX_POLL_INTERVAL, FIFOBOX_DEADLINE_MARGIN,
// FIFOBOX_METRICS_INTERVAL, FIFOBOX_METRICS_NAMESPACE.
package main

import (
	"context"

	"github.com/aws/aws-lambda-go/lambda"

	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/metrics"
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
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	t, err := lambdafn.OpenTransport(ctx, awsCfg) // kept for the environment's lifetime
	if err != nil {
		return nil, err
	}
	pub, err := t.Publisher()
	if err != nil {
		return nil, err
	}
	return dispatcher.New(pool, pub, metrics.FromEnv(), cfg)
}
