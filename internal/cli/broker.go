package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/readmodel"
)

func (a *app) provisionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "provision",
		Short: "Create the transport's topology (SNS topic and SQS queues, RabbitMQ exchanges and queues, or NATS streams and consumers); idempotent",
		Long: `Creates the topology of the transport FIFOBOX_TRANSPORT names: with sns the default
topology's topic, queues, DLQs and subscriptions at AWS_ENDPOINT_URL (on AWS the CDK
stack creates them); with rabbitmq or nats what FIFOBOX_AMQP_TOPOLOGY or
FIFOBOX_NATS_TOPOLOGY describes. Running it again changes nothing; an existing broker
entity whose settings differ from the definition is reported, not replaced.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.viaLambda != "" {
				return errNoLocal
			}
			t, err := a.transport(cmd.Context())
			if err != nil {
				return err
			}
			prov, err := t.Provisioner()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Minute)
			defer cancel()
			if err := prov.Provision(ctx); err != nil {
				return fmt.Errorf("provision %s topology: %w", t.Kind(), err)
			}
			fmt.Fprintf(a.out, "%s topology provisioned: %s\n", t.Kind(), t)
			return nil
		},
	}
}

// processLogger is the long-running commands' log: JSON on stderr, as the
// Lambdas write it (CloudWatch Logs, or any collector).
func (a *app) processLogger() *slog.Logger {
	lvl := slog.LevelInfo
	if a.verbose {
		lvl = slog.LevelDebug
	}
	return slog.New(slog.NewJSONHandler(a.errOut, &slog.HandlerOptions{Level: lvl}))
}

// runningLong is what dispatch and consume share: the same environment as
// the Lambdas, a health endpoint or liveness file, and a graceful stop on
// SIGTERM or SIGINT (a second one kills at once).
const runningLong = `

It reads the same environment as the Lambda: FIFOBOX_TRANSPORT and that
transport's settings (broker secrets from Secrets Manager through
FIFOBOX_AMQP_SECRET_ARN / FIFOBOX_NATS_SECRET_ARN), and the database as
FIFOBOX_DATABASE_URL or FIFOBOX_DB_HOST/PORT/NAME/USER with
FIFOBOX_DB_IAM_AUTH=true (or --database-url). On SIGTERM or SIGINT it
finishes the batch in hand (published and recorded, or applied and
settled), then exits 0; a second signal kills it at once. --health-addr
serves GET /healthz (200 while the database answers and the loop runs) and
--liveness-file is touched after every check, for ECS and Kubernetes probes
(docs/operations.md, "Running as a long-running process").`

func (a *app) dispatchCmd() *cobra.Command {
	var hf healthFlags
	c := &cobra.Command{
		Use:   "dispatch",
		Short: "Run the dispatcher as a long-running process (ECS, Kubernetes, a VM) until SIGTERM",
		Long: `dispatch publishes outbox events as the dispatcher Lambda does, but without stopping:
it claims due aggregates, publishes each one's events in order and records the
outcome, polling FIFOBOX_POLL_INTERVAL apart when nothing is due, and emits the
same EMF metrics on stdout (FIFOBOX_METRICS_INTERVAL). Any number may run beside
each other and beside the scheduled Lambda: the claim leases aggregates, so
order holds. Its knobs are the Lambda's: FIFOBOX_BATCH_SIZE, FIFOBOX_MAX_RUN,
FIFOBOX_PUBLISH_CONCURRENCY, FIFOBOX_RETRY_FOR and the rest
(pkg/lambdafn/dispatcher.Env).` + runningLong,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.viaLambda != "" {
				return errNoLocal
			}
			ctx := cmd.Context()
			log := a.processLogger()
			cfg, err := dispatcher.ConfigFromEnv()
			if err != nil {
				return err
			}
			cfg.Logger = log
			pool, err := a.connect(ctx)
			if err != nil {
				return err
			}
			t, err := a.transport(ctx)
			if err != nil {
				return err
			}
			pub, err := t.Publisher()
			if err != nil {
				return err
			}
			h, err := dispatcher.New(pool, pub, metrics.FromEnv(), cfg)
			if err != nil {
				return err
			}
			stop, err := hf.start(ctx, log, pool.Ping)
			if err != nil {
				return err
			}
			defer stop()
			log.Info("dispatcher running", "transport", t.String(), "pid", os.Getpid())
			var published int64
			for ctx.Err() == nil {
				res, err := h.Handle(ctx, nil)
				published += res.Published
				if err != nil && ctx.Err() == nil {
					log.Warn("dispatcher run failed; retrying", "error", err.Error())
					select {
					case <-ctx.Done():
					case <-time.After(time.Second):
					}
				}
			}
			log.Info("dispatcher stopped: every claimed batch was published and recorded", "published", published)
			return nil
		},
	}
	hf.register(c)
	return c
}

func (a *app) consumeCmd() *cobra.Command {
	var consumer string
	var hf healthFlags
	c := &cobra.Command{
		Use:   "consume",
		Short: "Run one consumer as a long-running process until SIGTERM (the example side effect, through the inbox)",
		Long: `Runs the transport's consumer for --consumer: each message is applied in
one transaction with its inbox row, then acknowledged; transient failures
retry with backoff, invalid and exhausted messages go to the dead-letter
queue or stream. It reconnects on its own after broker outages.

With sns it polls the consumer's SQS queue (FIFOBOX_QUEUES, or the topology's
queue name) and runs the consumer Lambda's handler, as Lambda's event source
does. This is how NATS consumers run on AWS (NATS has no Lambda event source),
and how any consumer runs on ECS, Kubernetes or a VM. The side effect is the
example one the consumer Lambda applies (orders-projection keeps
orders_read_model; other consumers record the event in the inbox only);
services embed the transport's runner with their own.` + runningLong,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.viaLambda != "" {
				return errNoLocal
			}
			if consumer == "" {
				return errors.New("--consumer is required (or FIFOBOX_CONSUMER_NAME)")
			}
			ctx := cmd.Context()
			log := a.processLogger()
			t, err := a.transport(ctx)
			if err != nil {
				return err
			}
			pool, err := a.connect(ctx)
			if err != nil {
				return err
			}
			if consumer == readmodel.Projection {
				if err := readmodel.Ensure(ctx, pool); err != nil {
					return err
				}
			}
			r, err := t.Consumer(consumer, pool, readmodel.ForConsumer(consumer))
			if err != nil {
				return err
			}
			stop, err := hf.start(ctx, log, pool.Ping)
			if err != nil {
				return err
			}
			defer stop()
			log.Info("consumer running", "consumer", consumer, "transport", t.String(), "pid", os.Getpid())
			if err := r.Run(ctx); err != nil {
				return fmt.Errorf("consumer %s: %w", consumer, err)
			}
			log.Info("consumer stopped: every message in hand was applied and settled", "consumer", consumer)
			return nil
		},
	}
	c.Flags().StringVar(&consumer, "consumer", os.Getenv("FIFOBOX_CONSUMER_NAME"), "the topology consumer to run (env FIFOBOX_CONSUMER_NAME, as the consumer Lambda)")
	hf.register(c)
	return c
}
