// Package consumer wires a consumer Lambda: the inbox batch handler
// (pkg/inbox) around a side effect, with EMF metrics per batch. The Lambda
// (functions/consumer) and the local event-source runner (make local) build
// it the same way, so what runs locally is what runs in AWS.
package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-lambda-go/events"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// Config configures a consumer function.
type Config struct {
	// Transport is where the function's records come from
	// (FIFOBOX_TRANSPORT): SNS (SQS FIFO queues, the default) or RabbitMQ
	// (Amazon MQ). NATS has no Lambda event source: its consumers run the
	// transport's runner (`fifobox consume`). Empty means SNS.
	Transport transport.Kind
	// Consumer is the consumer's name: its inbox key and metric dimension
	// (FIFOBOX_CONSUMER_NAME). Required.
	Consumer string
	// DLQURL is the queue's dead-letter queue for permanent and invalid
	// messages (FIFOBOX_DLQ_URL). Required with SNS; RabbitMQ dead-letters
	// through the queue's topology instead.
	DLQURL string
	// Order is "strict" or "relaxed" (FIFOBOX_CONSUMER_ORDER; see
	// inbox.Order). Empty: the default topology's setting for this
	// consumer, else strict.
	Order string
	// MaxReceiveCount is the queue's maxReceiveCount
	// (FIFOBOX_MAX_RECEIVE_COUNT), so the handler knows a record's last
	// receive. 0: the default topology's value for this consumer, else
	// unknown.
	MaxReceiveCount int
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
	if c.Transport == "" {
		c.Transport = transport.SNS
	}
	switch {
	case c.Transport == transport.NATS:
		return fmt.Errorf("%s=nats: NATS has no Lambda event source; run the consumer as a service with `fifobox consume` (docs/transports-nats.md)", transport.EnvTransport)
	case c.Transport != transport.SNS && c.Transport != transport.RabbitMQ:
		return fmt.Errorf("%s=%q: want sns or rabbitmq", transport.EnvTransport, c.Transport)
	case c.Consumer == "":
		return errors.New("FIFOBOX_CONSUMER_NAME is required")
	case c.Transport == transport.SNS && c.DLQURL == "":
		return errors.New("FIFOBOX_DLQ_URL is required with FIFOBOX_TRANSPORT=sns (the default)")
	case c.Transport != transport.SNS && c.DLQURL != "":
		return fmt.Errorf("FIFOBOX_DLQ_URL is set, but %s=%s dead-letters through the queue's topology: remove it", transport.EnvTransport, c.Transport)
	case c.MaxReceiveCount < 0 || c.MaxReceiveCount > 1000:
		return fmt.Errorf("FIFOBOX_MAX_RECEIVE_COUNT=%d: want 1-1000", c.MaxReceiveCount)
	case c.DeadlineMargin < 0:
		return fmt.Errorf("FIFOBOX_DEADLINE_MARGIN=%s: must not be negative", c.DeadlineMargin)
	}
	if _, err := inbox.ParseOrder(c.Order); err != nil {
		return fmt.Errorf("FIFOBOX_CONSUMER_ORDER: %w", err)
	}
	return nil
}

// Env is every variable ConfigFromEnv reads (declare a new one here; the
// runtime contract tests check the CDK template against this list).
var Env = envspec.Set{
	{Name: "FIFOBOX_CONSUMER_NAME", Required: true, Doc: "the consumer's name: inbox key, metric dimension, side effect"},
	{Name: transport.EnvTransport, Doc: "sns (default) or rabbitmq: the event source (the broker's own settings: lambdafn.BrokerEnv)"},
	{Name: "FIFOBOX_DLQ_URL", Doc: "the consumer queue's FIFO dead-letter queue URL (required with sns)"},
	{Name: "FIFOBOX_CONSUMER_ORDER", Doc: "strict (default) or relaxed per-aggregate order after a dead-lettered event (sns)"},
	{Name: "FIFOBOX_MAX_RECEIVE_COUNT", Doc: "the queue's maxReceiveCount (1-1000; default from the topology; sns)"},
	{Name: "FIFOBOX_DEADLINE_MARGIN", Doc: "no record starts this close to the invocation's deadline (Go duration, default 3s)"},
	{Name: "FIFOBOX_LOG_AGGREGATE_IDS", Doc: "log group (aggregate) ids (true/false, default false)"},
}

// ConfigFromEnv reads the variables in Env.
func ConfigFromEnv() (Config, error) {
	kind, err := transport.ParseKind(Env.Get(transport.EnvTransport))
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", transport.EnvTransport, err)
	}
	c := Config{Transport: kind, Consumer: Env.Get("FIFOBOX_CONSUMER_NAME"), DLQURL: Env.Get("FIFOBOX_DLQ_URL"), Order: Env.Get("FIFOBOX_CONSUMER_ORDER")}
	if v := Env.Get("FIFOBOX_MAX_RECEIVE_COUNT"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			return c, fmt.Errorf("FIFOBOX_MAX_RECEIVE_COUNT=%q: want 1-1000 (the queue's maxReceiveCount)", v)
		}
		c.MaxReceiveCount = n
	}
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

// New returns the consumer's SQS batch handler. em may be nil (no metrics).
func New(db inbox.DB, dlq inbox.DLQSender, apply inbox.Apply, em *metrics.Emitter, cfg Config) (*inbox.Handler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if tc, ok := topology.Default().Consumer(cfg.Consumer); ok {
		if cfg.Order == "" {
			cfg.Order = tc.OrderName()
		}
		if cfg.MaxReceiveCount == 0 {
			cfg.MaxReceiveCount = tc.MaxReceiveCount
		}
	}
	order, _ := inbox.ParseOrder(cfg.Order) // checked by Validate
	hc := inbox.HandlerConfig{Consumer: cfg.Consumer, DLQURL: cfg.DLQURL, Order: order, MaxReceiveCount: cfg.MaxReceiveCount,
		DeadlineMargin: cfg.DeadlineMargin, LogAggregateIDs: cfg.LogAggregateIDs, Logger: log}
	if em != nil {
		hc.OnBatch = func(m inbox.BatchMetrics) {
			if err := em.InboxBatch(m); err != nil {
				log.Warn("emit consumer metrics failed", "error", err.Error())
			}
		}
	}
	return inbox.NewHandler(db, dlq, apply, hc)
}

// AMQPHandler is the consumer's handler for Lambda's Amazon MQ (RabbitMQ)
// event source: amqp.LambdaHandler, which applies each record through the
// inbox and settles every record itself (retry queue or DLQ) because that
// event source has no partial batch response, plus one EMF metrics line per
// invocation, as the SQS consumer emits per batch.
type AMQPHandler struct {
	h   *amqp.LambdaHandler
	em  *metrics.Emitter
	log *slog.Logger

	mu  sync.Mutex // Lambda runs one invocation at a time; settles arrive from lanes
	acc metrics.ConsumerBatch
}

// NewAMQP returns the handler. broker is the transport's configuration
// with credentials (lambdafn.Broker); em may be nil (no metrics).
func NewAMQP(db inbox.DB, apply inbox.Apply, broker amqp.Config, em *metrics.Emitter, cfg Config) (*AMQPHandler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	if cfg.Transport != transport.RabbitMQ {
		return nil, fmt.Errorf("new consumer: %s=%q, not rabbitmq", transport.EnvTransport, cfg.Transport)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	broker.Logger = cfg.Logger
	a := &AMQPHandler{em: em, log: cfg.Logger}
	h, err := amqp.NewLambdaHandler(broker, db, apply, amqp.ConsumerConfig{
		Consumer: cfg.Consumer, LogAggregateIDs: cfg.LogAggregateIDs, OnSettle: a.settled,
	})
	if err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	a.h = h
	a.acc.Consumer = cfg.Consumer
	return a, nil
}

func (a *AMQPHandler) settled(st amqp.Settlement) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch st.Action {
	case amqp.ActionApplied:
		a.acc.Processed++
	case amqp.ActionDuplicate:
		a.acc.Duplicates++
	default: // retried, forwarded behind a retrying head, dead-lettered
		a.acc.Failures++
	}
	if !st.Envelope.OccurredAt.IsZero() {
		a.acc.Lag = max(a.acc.Lag, time.Since(st.Envelope.OccurredAt))
	}
}

// Handle processes one invocation's records and emits its metrics.
func (a *AMQPHandler) Handle(ctx context.Context, ev events.RabbitMQEvent) error {
	err := a.h.Handle(ctx, ev)
	a.mu.Lock()
	batch := a.acc
	a.acc = metrics.ConsumerBatch{Consumer: batch.Consumer}
	a.mu.Unlock()
	if a.em != nil {
		if merr := a.em.Consumer(batch); merr != nil {
			a.log.Warn("emit consumer metrics failed", "error", merr.Error())
		}
	}
	return err
}
