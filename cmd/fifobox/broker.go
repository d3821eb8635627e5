package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/nats"
)

// brokerTransport opens the transport FIFOBOX_TRANSPORT names. SNS/SQS has
// none here: its topology is CDK's (or make local's) and its consumers are
// Lambdas.
func (a *app) brokerTransport(what string) (transport.Transport, error) {
	kind, err := transport.KindFromEnv()
	if err != nil {
		return nil, err
	}
	switch kind {
	case transport.RabbitMQ:
		cfg, err := amqp.ConfigFromEnv()
		if err != nil {
			return nil, err
		}
		cfg.Logger = a.logger()
		return amqp.New(cfg)
	case transport.NATS:
		cfg, err := nats.ConfigFromEnv()
		if err != nil {
			return nil, err
		}
		cfg.Logger = a.logger()
		return nats.New(cfg)
	}
	return nil, fmt.Errorf("%s works with %s=rabbitmq or nats; with sns the topology is deployed by CDK and consumers are Lambdas", what, transport.EnvTransport)
}

func (a *app) provisionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "provision",
		Short: "Create the broker's topology (RabbitMQ exchanges and queues, or NATS streams and consumers); idempotent, reports drift",
		Long: `Creates what FIFOBOX_AMQP_TOPOLOGY or FIFOBOX_NATS_TOPOLOGY describes on the broker
FIFOBOX_TRANSPORT names. Running it again changes nothing; an existing entity
whose settings differ from the definition is reported, not replaced.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			t, err := a.brokerTransport("provision")
			if err != nil {
				return err
			}
			defer t.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Minute)
			defer cancel()
			if err := t.Provisioner().Provision(ctx); err != nil {
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
		Short: "Run one consumer against RabbitMQ or NATS until interrupted (the example side effect, through the inbox)",
		Long: `Runs the transport's consumer for --consumer: each message is applied in
one transaction with its inbox row, then acknowledged; transient failures
retry with backoff, invalid and exhausted messages go to the dead-letter
queue or stream. It reconnects on its own after broker outages and stops
cleanly on SIGINT or SIGTERM.

This is how NATS consumers run on AWS (NATS has no Lambda event source): as
a long-running task (ECS, EC2) next to the dispatcher. The side effect is the
example one the consumer Lambda applies (orders-projection keeps
orders_read_model; other consumers record the event in the inbox only);
services embed the transport's runner with their own.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if consumer == "" {
				return errors.New("--consumer is required")
			}
			t, err := a.brokerTransport("consume")
			if err != nil {
				return err
			}
			defer t.Close()
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
