package amqp

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/aws/aws-lambda-go/events"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/transport"
)

// LambdaHandler returns the consumer function's handler for Lambda's
// Amazon MQ (RabbitMQ) event source (transport.LambdaConsumer): a
// LambdaHandler, which settles every record itself because that event
// source has no partial batch response, plus one EMF metrics line per
// invocation, as the SQS consumer emits per batch.
func (t *Transport) LambdaHandler(lc transport.LambdaConfig) (any, error) {
	if err := t.inTopology(lc.Consumer); err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	if lc.Logger == nil {
		lc.Logger = slog.Default()
	}
	cfg := t.cfg
	cfg.Logger = lc.Logger
	m := &lambdaMetrics{em: lc.Metrics, log: lc.Logger}
	m.acc.Consumer = lc.Consumer
	table, err := inbox.TableFromEnv()
	if err != nil {
		return nil, err
	}
	h, err := NewLambdaHandler(cfg, lc.DB, lc.Apply, inbox.ConsumerConfig{
		Consumer: lc.Consumer, Inbox: table, LogAggregateIDs: lc.LogAggregateIDs, OnSettle: m.settled, DeadlineMargin: lc.DeadlineMargin, Logger: lc.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	m.h = h
	return m.Handle, nil
}

// lambdaMetrics counts one invocation's settlements for its metrics line.
type lambdaMetrics struct {
	h   *LambdaHandler
	em  *metrics.Emitter
	log *slog.Logger

	mu  sync.Mutex // Lambda runs one invocation at a time; settles arrive from lanes
	acc metrics.ConsumerBatch
}

func (a *lambdaMetrics) settled(st inbox.Settlement) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch st.Action {
	case inbox.ActionApplied:
		a.acc.Processed++
	case inbox.ActionDuplicate:
		a.acc.Duplicates++
	default: // retried, deferred behind a retrying head, dead-lettered, held
		a.acc.Failures++
	}
	if !st.Envelope.OccurredAt.IsZero() {
		a.acc.Lag = max(a.acc.Lag, time.Since(st.Envelope.OccurredAt))
	}
}

// Handle processes one invocation's records and emits its metrics.
func (a *lambdaMetrics) Handle(ctx context.Context, ev events.RabbitMQEvent) error {
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
