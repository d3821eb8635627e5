// Package consumer wires a consumer Lambda: the inbox batch handler
// (pkg/inbox) around a side effect, with EMF metrics per batch. The Lambda
// (functions/consumer) and the local event-source runner (make local) build
// it the same way, so what runs locally is what runs in AWS.
package consumer

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/metrics"
)

// Config configures a consumer function.
type Config struct {
	// Consumer is the consumer's name: its inbox key and metric dimension
	// (FIFOBOX_CONSUMER_NAME). Required.
	Consumer string
	// DLQURL is the queue's dead-letter queue for permanent and invalid
	// messages (FIFOBOX_DLQ_URL). Required.
	DLQURL string
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Validate reports the first missing setting, named by its variable.
func (c Config) Validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("FIFOBOX_CONSUMER_NAME is required")
	case c.DLQURL == "":
		return errors.New("FIFOBOX_DLQ_URL is required")
	}
	return nil
}

// Env is every variable ConfigFromEnv reads (declare a new one here; the
// runtime contract tests check the CDK template against this list).
var Env = envspec.Set{
	{Name: "FIFOBOX_CONSUMER_NAME", Required: true, Doc: "the consumer's name: inbox key, metric dimension, side effect"},
	{Name: "FIFOBOX_DLQ_URL", Required: true, Doc: "the consumer queue's FIFO dead-letter queue URL"},
}

// ConfigFromEnv reads FIFOBOX_CONSUMER_NAME and FIFOBOX_DLQ_URL.
func ConfigFromEnv() (Config, error) {
	c := Config{Consumer: Env.Get("FIFOBOX_CONSUMER_NAME"), DLQURL: Env.Get("FIFOBOX_DLQ_URL")}
	return c, c.Validate()
}

// New returns the consumer's SQS batch handler. em may be nil (no metrics).
func New(db inbox.DB, dlq inbox.DLQSender, apply inbox.Apply, em *metrics.Emitter, cfg Config) (*inbox.Handler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	hc := inbox.HandlerConfig{Consumer: cfg.Consumer, DLQURL: cfg.DLQURL, Logger: log}
	if em != nil {
		hc.OnBatch = func(m inbox.BatchMetrics) {
			if err := em.InboxBatch(m); err != nil {
				log.Warn("emit consumer metrics failed", "error", err.Error())
			}
		}
	}
	return inbox.NewHandler(db, dlq, apply, hc)
}
