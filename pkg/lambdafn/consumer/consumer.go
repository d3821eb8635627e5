// Package consumer wires a consumer Lambda: the transport's handler for its
// Lambda event source (transport.LambdaConsumer: the SQS FIFO batch handler
// for sns, Amazon MQ's for rabbitmq) around a side effect, with EMF metrics.
// The transport is whichever FIFOBOX_TRANSPORT names (transport.Open); this
// package does not know which.
package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Config configures a consumer function.
type Config struct {
	// Consumer is the consumer's name: its inbox key and metric dimension
	// (FIFOBOX_CONSUMER_NAME). Required.
	Consumer string
	// DeadlineMargin: no record starts this close to the invocation's
	// deadline (FIFOBOX_DEADLINE_MARGIN, a Go duration; default 3s).
	DeadlineMargin time.Duration
	// LogAggregateIDs adds message group (aggregate) ids to log lines
	// (FIFOBOX_LOG_AGGREGATE_IDS=true). Off by default: they may carry
	// personal data.
	LogAggregateIDs bool
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Validate reports the first missing or invalid setting, named by its variable.
func (c Config) Validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("FIFOBOX_CONSUMER_NAME is required")
	case c.DeadlineMargin < 0:
		return fmt.Errorf("FIFOBOX_DEADLINE_MARGIN=%s: must not be negative", c.DeadlineMargin)
	}
	return nil
}

// Env is every variable ConfigFromEnv reads (declare a new one here; the
// runtime contract tests check the CDK template against this list). The
// transport's own (FIFOBOX_DLQ_URL for sns, the broker's URL and secret)
// are transport.RegisteredEnv's.
var Env = envspec.Set{
	{Name: "FIFOBOX_CONSUMER_NAME", Required: true, Doc: "the consumer's name: inbox key, metric dimension, side effect"},
	{Name: "FIFOBOX_DEADLINE_MARGIN", Doc: "no record starts this close to the invocation's deadline (Go duration, default 3s)"},
	{Name: "FIFOBOX_LOG_AGGREGATE_IDS", Doc: "log group (aggregate) ids (true/false, default false)"},
}

// ConfigFromEnv reads the variables in Env.
func ConfigFromEnv() (Config, error) {
	c := Config{Consumer: Env.Get("FIFOBOX_CONSUMER_NAME")}
	if v := Env.Get("FIFOBOX_DEADLINE_MARGIN"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return c, fmt.Errorf("FIFOBOX_DEADLINE_MARGIN=%q: want a Go duration such as 3s", v)
		}
		c.DeadlineMargin = d
	}
	if v := Env.Get("FIFOBOX_LOG_AGGREGATE_IDS"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return c, fmt.Errorf("FIFOBOX_LOG_AGGREGATE_IDS=%q: want true or false", v)
		}
		c.LogAggregateIDs = b
	}
	return c, c.Validate()
}

// New returns the consumer function's handler (for lambda.Start) for t's
// Lambda event source, applying events with apply through the inbox in db.
// em may be nil (no metrics). A transport without a Lambda event source
// (NATS) is an error naming FIFOBOX_TRANSPORT.
func New(t transport.Transport, db inbox.DB, apply inbox.Apply, em *metrics.Emitter, cfg Config) (any, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	lc, ok := t.(transport.LambdaConsumer)
	if !ok {
		return nil, fmt.Errorf("%s=%s: this transport has no Lambda event source; run the consumer as a service with `fifobox consume`",
			transport.EnvTransport, t.Kind())
	}
	return lc.LambdaHandler(transport.LambdaConfig{Consumer: cfg.Consumer, DB: db, Apply: apply, DeadlineMargin: cfg.DeadlineMargin,
		LogAggregateIDs: cfg.LogAggregateIDs, Metrics: em, Logger: cfg.Logger})
}
