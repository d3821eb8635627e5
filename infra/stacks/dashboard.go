package stacks

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatch"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambda"
	"github.com/aws/aws-cdk-go/awscdk/v2/interfaces/interfacesawscloudwatch"
	"github.com/aws/jsii-runtime-go"
)

func graph(title string, width float64, left []awscloudwatch.IMetric, threshold *float64) awscloudwatch.IWidget {
	props := &awscloudwatch.GraphWidgetProps{
		Title: jsii.String(title), Width: jsii.Number(width), Height: jsii.Number(6), Left: &left,
	}
	if threshold != nil {
		props.LeftAnnotations = &[]*awscloudwatch.HorizontalAnnotation{{Value: threshold, Label: jsii.String("alarm threshold")}}
	}
	return awscloudwatch.NewGraphWidget(props)
}

func row(w ...awscloudwatch.IWidget) *[]awscloudwatch.IWidget { return &w }

// newDashboard shows the alarmed signals: alarm states first, then the outbox
// (publish lag, the backlog split into due, backing-off and parked, retrying
// aggregates, dead and parked), the dispatcher function and SNS delivery,
// and per consumer its lag, outcomes, queue age and DLQ depths.
func newDashboard(stack awscdk.Stack, cfg Config, p *Pipeline) {
	th := cfg.Thresholds
	alarms := make([]interfacesawscloudwatch.IAlarmRef, 0, len(p.Alarms))
	for _, a := range p.Alarms {
		alarms = append(alarms, a)
	}
	widgets := []*[]awscloudwatch.IWidget{
		row(awscloudwatch.NewAlarmStatusWidget(&awscloudwatch.AlarmStatusWidgetProps{
			Title: jsii.String("Alarms"), Alarms: &alarms, Width: jsii.Number(24), Height: jsii.Number(4),
		})),
		row(
			graph("Publish lag: oldest due event (s)", 6, []awscloudwatch.IMetric{
				dispatcherMetric(cfg, MetricOldestDueAgeSeconds, "Maximum", 60), dispatcherMetric(cfg, MetricOldestPendingAgeSeconds, "Maximum", 60)}, jsii.Number(th.PublishLagSeconds)),
			graph("Outbox backlog: due / backing off / parked", 6, []awscloudwatch.IMetric{
				dispatcherMetric(cfg, MetricDueEvents, "Maximum", 60), dispatcherMetric(cfg, MetricBackingOffEvents, "Maximum", 60),
				dispatcherMetric(cfg, MetricParkedEvents, "Maximum", 60), dispatcherMetric(cfg, MetricOutboxBacklog, "Maximum", 60)}, jsii.Number(th.DueBacklog)),
			graph("Retrying aggregates / dead events / parked aggregates", 6, []awscloudwatch.IMetric{
				dispatcherMetric(cfg, MetricRetryingAggregates, "Maximum", 60), dispatcherMetric(cfg, MetricDeadEvents, "Maximum", 300),
				dispatcherMetric(cfg, MetricParkedAggregates, "Maximum", 300)}, nil),
			graph("Published / retries per minute", 6, []awscloudwatch.IMetric{
				dispatcherMetric(cfg, MetricPublished, "Sum", 60), dispatcherMetric(cfg, MetricRetries, "Sum", 60)}, nil),
		),
		row(
			graph("Dispatcher invocations / errors / throttles", 6, []awscloudwatch.IMetric{
				p.Dispatcher.MetricInvocations(minutes(5)), p.Dispatcher.MetricErrors(minutes(5)), p.Dispatcher.MetricThrottles(minutes(5))}, nil),
			graph("Dispatcher duration (ms)", 6, []awscloudwatch.IMetric{p.Dispatcher.MetricDuration(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum")})}, nil),
			graph("Schedule DLQ (undelivered ticks)", 6, []awscloudwatch.IMetric{p.ScheduleDLQ.MetricApproximateNumberOfMessagesVisible(nil)}, nil),
			deliveryWidget(p),
		),
	}
	for _, cr := range p.Consumers {
		n := cr.Consumer.Name
		widgets = append(widgets, row(
			consumerLagGraph(cfg, n), consumerOutcomesGraph(cfg, n, cr.Function),
			graph(n+": oldest message age (s)", 6, []awscloudwatch.IMetric{
				cr.Queue.MetricApproximateAgeOfOldestMessage(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum")})}, jsii.Number(th.QueueOldestMessageAgeSeconds)),
			graph(n+": DLQ / subscription DLQ messages", 6, []awscloudwatch.IMetric{
				cr.DLQ.MetricApproximateNumberOfMessagesVisible(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum")}),
				cr.SubscriptionDLQ.MetricApproximateNumberOfMessagesVisible(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum")})}, jsii.Number(th.DLQVisibleMessages)),
		))
	}
	for _, bc := range p.BrokerConsumers {
		n := bc.Name
		widgets = append(widgets, row(
			consumerLagGraph(cfg, n), consumerOutcomesGraph(cfg, n, bc.Function),
			graph(n+": queue ready / unacknowledged", 6, []awscloudwatch.IMetric{
				brokerQueueMetric(cfg, p, bc.Queue, "MessageReadyCount", 1), brokerQueueMetric(cfg, p, bc.Queue, "MessageUnacknowledgedCount", 1)}, jsii.Number(th.BrokerQueueReadyMessages)),
			graph(n+": DLQ messages", 6, []awscloudwatch.IMetric{brokerQueueMetric(cfg, p, bc.DLQ, "MessageCount", 1)}, jsii.Number(th.DLQVisibleMessages)),
		))
	}
	p.Dashboard = awscloudwatch.NewDashboard(stack, jsii.String("Dashboard"), &awscloudwatch.DashboardProps{
		DashboardName:   jsii.String(cfg.Prefix),
		DefaultInterval: awscdk.Duration_Hours(jsii.Number(3)),
		Widgets:         &widgets,
	})
}

// deliveryWidget shows SNS's failed deliveries (SNS transport); with a
// broker, the dispatcher's retries stand for its delivery failures.
func deliveryWidget(p *Pipeline) awscloudwatch.IWidget {
	if p.Topic == nil {
		return graph("Operations function errors", 6, []awscloudwatch.IMetric{p.Redrive.MetricErrors(minutes(5))}, nil)
	}
	return graph("SNS deliveries failed / lost (not redriven to a DLQ)", 6, []awscloudwatch.IMetric{
		p.Topic.MetricNumberOfNotificationsFailed(minutes(5)),
		p.Topic.Metric(jsii.String("NumberOfNotificationsFailedToRedriveToDlq"), minutes(5))}, nil)
}

// consumerLagGraph and consumerOutcomesGraph are the first two graphs of
// every consumer's row, whatever feeds it.
func consumerLagGraph(cfg Config, n string) awscloudwatch.IWidget {
	return graph(n+": lag (s)", 6, []awscloudwatch.IMetric{consumerMetric(cfg, n, MetricConsumerLagSeconds, "Maximum", 60)}, jsii.Number(cfg.Thresholds.ConsumerLagSeconds))
}

func consumerOutcomesGraph(cfg Config, n string, fn awslambda.Function) awscloudwatch.IWidget {
	return graph(n+": processed / duplicates / failures / errors / throttles", 6, []awscloudwatch.IMetric{
		consumerMetric(cfg, n, MetricProcessed, "Sum", 60), consumerMetric(cfg, n, MetricDuplicates, "Sum", 60),
		consumerMetric(cfg, n, MetricFailures, "Sum", 60), fn.MetricErrors(minutes(1)), fn.MetricThrottles(minutes(1))}, nil)
}
