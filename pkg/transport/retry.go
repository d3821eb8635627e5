package transport

import (
	"fmt"
	"time"
)

// RetryPolicy is a consumer's redelivery schedule for transient failures:
// retry n (1-based) waits min(MaxDelay, InitialDelay * Multiplier^(n-1)),
// and a message that fails its MaxRetries-th retry goes to the dead-letter
// queue. Each transport realises it with what its broker has (delay queues
// with a TTL on RabbitMQ, NakWithDelay and MaxDeliver on JetStream).
type RetryPolicy struct {
	// MaxRetries is how many times a failed message is retried before it
	// is dead-lettered; 0 dead-letters at the first failure. Default 5.
	MaxRetries int `json:"max_retries"`
	// InitialDelay is the wait before the first retry. Default 1s.
	InitialDelay Duration `json:"initial_delay"`
	// Multiplier grows the delay per retry. Default 2.
	Multiplier float64 `json:"multiplier"`
	// MaxDelay caps a delay. Default 5m.
	MaxDelay Duration `json:"max_delay"`
}

// WithDefaults returns p with zero fields set to their defaults. A
// MaxRetries of 0 is kept only when the other fields are set, so the zero
// policy means "the defaults" rather than "never retry".
func (p RetryPolicy) WithDefaults() RetryPolicy {
	if p == (RetryPolicy{}) {
		p.MaxRetries = 5
	}
	if p.InitialDelay == 0 {
		p.InitialDelay = Duration(time.Second)
	}
	if p.Multiplier == 0 {
		p.Multiplier = 2
	}
	if p.MaxDelay == 0 {
		p.MaxDelay = Duration(5 * time.Minute)
	}
	return p
}

// Validate reports the first invalid field.
func (p RetryPolicy) Validate() error {
	switch {
	case p.MaxRetries < 0 || p.MaxRetries > 50:
		return fmt.Errorf("max_retries %d: must be 0-50", p.MaxRetries)
	case p.InitialDelay < Duration(time.Millisecond):
		return fmt.Errorf("initial_delay %s: must be at least 1ms", time.Duration(p.InitialDelay))
	case p.Multiplier < 1:
		return fmt.Errorf("multiplier %g: must be at least 1", p.Multiplier)
	case p.MaxDelay < p.InitialDelay:
		return fmt.Errorf("max_delay %s: must be at least initial_delay %s", time.Duration(p.MaxDelay), time.Duration(p.InitialDelay))
	}
	return nil
}

// Delay is the wait before retry n (1-based).
func (p RetryPolicy) Delay(n int) time.Duration {
	d := float64(p.InitialDelay)
	for i := 1; i < n; i++ {
		d *= p.Multiplier
		if d >= float64(p.MaxDelay) {
			return time.Duration(p.MaxDelay)
		}
	}
	return min(time.Duration(d), time.Duration(p.MaxDelay))
}
