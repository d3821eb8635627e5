package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

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
			fmt.Fprintf(a.out, "%s topology provisioned\n", t.Kind())
			return nil
		},
	}
}

func (a *app) consumeCmd() *cobra.Command {
	var consumer string
	c := &cobra.Command{
		Use:   "consume",
		Short: "Run one consumer as a long-running process until interrupted (the example side effect, through the inbox)",
		Long: `Runs the transport's consumer for --consumer: each message is applied in
one transaction with its inbox row, then acknowledged; transient failures
retry with backoff, invalid and exhausted messages go to the dead-letter
queue or stream. It reconnects on its own after broker outages and stops
cleanly on SIGINT or SIGTERM.

With sns it polls the consumer's SQS queue (FIFOBOX_QUEUES, or the topology's
queue name) and runs the consumer Lambda's handler. This is how NATS consumers
run on AWS (NATS has no Lambda event source): as a long-running task (ECS,
EC2) next to the dispatcher. The side effect is the
example one the consumer Lambda applies (orders-projection keeps
orders_read_model; other consumers record the event in the inbox only);
services embed the transport's runner with their own.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if consumer == "" {
				return errors.New("--consumer is required")
			}
			t, err := a.transport(cmd.Context())
			if err != nil {
				return err
			}
			pool, err := a.connect(cmd.Context())
			if err != nil {
				return err
			}
			r, err := t.Consumer(consumer, pool, readmodel.ForConsumer(consumer))
			if err != nil {
				return err
			}
			fmt.Fprintf(a.errOut, "fifobox: consuming %s through %s (Ctrl-C stops)\n", consumer, t.Kind())
			return r.Run(cmd.Context())
		},
	}
	c.Flags().StringVar(&consumer, "consumer", "", "the topology consumer to run (required)")
	return c
}
