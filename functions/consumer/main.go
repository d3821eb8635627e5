// Command consumer is the example consumer Lambda (provided.al2023,
// bootstrap), triggered by an SQS FIFO event source mapping with
// ReportBatchItemFailures. Each record's side effect runs in one transaction
// with its inbox row (pkg/inbox), so it applies once however often SQS
// delivers it. The side effect is chosen by consumer name
// (readmodel.ForConsumer): orders-projection keeps orders_read_model current.
//
// Environment: FIFOBOX_CONSUMER_NAME, FIFOBOX_DLQ_URL (required);
// FIFOBOX_CONSUMER_ORDER (strict, the default, or relaxed),
// FIFOBOX_MAX_RECEIVE_COUNT (the queue's maxReceiveCount), FIFOBOX_DEADLINE_MARGIN
// (default 3s), FIFOBOX_LOG_AGGREGATE_IDS (default false); database
// as in pkg/db (FIFOBOX_DATABASE_URL, or FIFOBOX_DB_HOST/PORT/NAME/USER with
// FIFOBOX_DB_IAM_AUTH=true); FIFOBOX_METRICS_NAMESPACE (default Fifobox).
package main

import (
	"context"
	"log/slog"

	"github.com/aws/aws-lambda-go/lambda"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/inbox"
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
	lambda.Start(h.Handle)
}

func setup(ctx context.Context, log *slog.Logger) (*inbox.Handler, error) {
	cfg, err := consumer.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	cfg.Logger = log
	pool, awsCfg, err := lambdafn.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return consumer.New(pool, awsclient.SQS(awsCfg), readmodel.ForConsumer(cfg.Consumer), metrics.FromEnv(), cfg)
}
