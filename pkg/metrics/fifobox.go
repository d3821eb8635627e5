package metrics

import (
	"sync"
	"time"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Dimension names and the dispatcher's dimension value.
const (
	DimService        = "Service"
	DimConsumer       = "Consumer"
	ServiceDispatcher = "dispatcher"
)

// Dispatcher metric names (dimension Service=dispatcher).
const (
	// Gauges, from outbox.Stats.
	MetricOutboxBacklog           = "OutboxBacklog"           // pending events (Count)
	MetricOldestPendingAgeSeconds = "OldestPendingAgeSeconds" // publish lag of the oldest pending event (Seconds)
	MetricDeadEvents              = "DeadEvents"              // dead rows now (Count)
	MetricParkedAggregates        = "ParkedAggregates"        // aggregates held back by a dead event (Count)
	// The backlog split by what it means (each alarms on its own):
	MetricDueEvents          = "OutboxDueEvents"        // unsent events publishable now or in flight: not backing off, not parked (Count)
	MetricBackingOffEvents   = "OutboxBackingOffEvents" // unsent events of aggregates whose head waits out a retry backoff (Count)
	MetricParkedEvents       = "OutboxParkedEvents"     // unsent events held behind a dead head, the dead head included (Count)
	MetricOldestDueAgeSecond = "OldestDueAgeSeconds"    // publish lag: age of the oldest due event, parked and backing-off ones excluded (Seconds)
	MetricRetryingAggregates = "RetryingAggregates"     // aggregates whose head is backing off after a retryable publish failure (Count)
	MetricStrandedEvents     = "OutboxStrandedEvents"   // events pending > outbox.StrandedAfter that no claim can reach: never published until repaired (Count)
	// The server's oldest transaction holding back vacuum, in any database of the cluster (Seconds).
	MetricOldestTransactionAgeSeconds = "OldestTransactionAgeSeconds"
	// Counters, summed over batches.
	MetricPublished        = "Published"        // events the broker acknowledged (Count)
	MetricRetries          = "Retries"          // publish failures scheduled for retry (Count)
	MetricDead             = "Dead"             // events that went dead (Count)
	MetricPublishLatencyMs = "PublishLatencyMs" // wall time of each batch's publish step (Milliseconds, one sample per batch)
)

// Consumer metric names (dimension Consumer=<name>).
const (
	MetricProcessed          = "Processed"          // side effects applied (Count)
	MetricDuplicates         = "Duplicates"         // deliveries already applied, skipped by the inbox (Count)
	MetricFailures           = "Failures"           // records that failed (Count)
	MetricConsumerLagSeconds = "ConsumerLagSeconds" // largest now - occurred_at in the batch (Seconds)
)

// DispatcherBacklog emits the outbox gauges of a Stats snapshot.
func (e *Emitter) DispatcherBacklog(b outbox.Backlog) error {
	return e.Emit(map[string]string{DimService: ServiceDispatcher},
		Metric{Name: MetricOutboxBacklog, Unit: Count, Value: float64(b.Pending)},
		Metric{Name: MetricOldestPendingAgeSeconds, Unit: Seconds, Value: b.OldestPendingAge.Seconds()},
		Metric{Name: MetricDeadEvents, Unit: Count, Value: float64(b.Dead)},
		Metric{Name: MetricParkedAggregates, Unit: Count, Value: float64(b.ParkedAggregates)},
		Metric{Name: MetricDueEvents, Unit: Count, Value: float64(b.DueEvents)},
		Metric{Name: MetricBackingOffEvents, Unit: Count, Value: float64(b.BackingOffEvents)},
		Metric{Name: MetricParkedEvents, Unit: Count, Value: float64(b.ParkedEvents)},
		Metric{Name: MetricOldestDueAgeSecond, Unit: Seconds, Value: b.OldestDueAge.Seconds()},
		Metric{Name: MetricRetryingAggregates, Unit: Count, Value: float64(b.RetryingAggregates)},
		Metric{Name: MetricStrandedEvents, Unit: Count, Value: float64(b.StrandedEvents)},
		Metric{Name: MetricOldestTransactionAgeSeconds, Unit: Seconds, Value: b.OldestTransactionAge.Seconds()},
	)
}

// BatchCounter sums dispatcher batches between flushes. Add is safe to call
// from several dispatcher workers (it fits DispatcherConfig.OnBatch).
type BatchCounter struct {
	mu                       sync.Mutex
	batches                  int
	published, retries, dead int64
	latencies                []float64
}

// Add counts one batch.
func (c *BatchCounter) Add(r outbox.BatchResult) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.batches++
	c.published += int64(r.Sent)
	c.retries += int64(r.Retried)
	c.dead += int64(r.Dead)
	c.latencies = append(c.latencies, float64(r.PublishDuration.Microseconds())/1000)
	if len(c.latencies) > maxSamples {
		c.latencies = c.latencies[len(c.latencies)-maxSamples:]
	}
}

// Flush emits the counts since the last flush (nothing if no batch ran) and resets them.
func (c *BatchCounter) Flush(e *Emitter) error {
	c.mu.Lock()
	if c.batches == 0 {
		c.mu.Unlock()
		return nil
	}
	ms := []Metric{
		{Name: MetricPublished, Unit: Count, Value: float64(c.published)},
		{Name: MetricRetries, Unit: Count, Value: float64(c.retries)},
		{Name: MetricDead, Unit: Count, Value: float64(c.dead)},
		{Name: MetricPublishLatencyMs, Unit: Milliseconds, Values: c.latencies},
	}
	c.batches, c.published, c.retries, c.dead, c.latencies = 0, 0, 0, 0, nil
	c.mu.Unlock()
	return e.Emit(map[string]string{DimService: ServiceDispatcher}, ms...)
}

// ConsumerBatch is one consumer batch's metrics.
type ConsumerBatch struct {
	// Consumer is the consumer's name (the metric dimension).
	Consumer   string
	Processed  int
	Duplicates int
	Failures   int
	// Lag is the largest now - occurred_at among the batch's events.
	Lag time.Duration
}

// Consumer emits a consumer batch's metrics. Consumer Lambdas call it once
// per batch, e.g. from sns.HandlerConfig.OnBatch via InboxBatch.
func (e *Emitter) Consumer(b ConsumerBatch) error {
	name := b.Consumer
	if name == "" {
		name = "unknown"
	}
	return e.Emit(map[string]string{DimConsumer: name},
		Metric{Name: MetricProcessed, Unit: Count, Value: float64(b.Processed)},
		Metric{Name: MetricDuplicates, Unit: Count, Value: float64(b.Duplicates)},
		Metric{Name: MetricFailures, Unit: Count, Value: float64(b.Failures)},
		Metric{Name: MetricConsumerLagSeconds, Unit: Seconds, Value: b.Lag.Seconds()},
	)
}

// InboxBatch emits an SQS consumer batch's metrics; use it as
// sns.HandlerConfig{OnBatch: func(m inbox.BatchMetrics) { _ = em.InboxBatch(m) }}.
func (e *Emitter) InboxBatch(m inbox.BatchMetrics) error {
	failures := 0
	for _, n := range m.Failures {
		failures += n
	}
	return e.Consumer(ConsumerBatch{Consumer: m.Consumer, Processed: m.Processed, Duplicates: m.Duplicates, Failures: failures, Lag: m.MaxLag})
}
